//! The one door to the file system for everything `collect` reads.
//!
//! Every path handed to a `Sysroot` is relative to its root (`/` on a live machine, a fixture
//! tree in tests, an unpacked bundle for support). Absolute symlink targets are resolved
//! inside the root, as a chroot would, so a fixture's `lib/modules/*/build ->
//! /usr/src/linux-headers-…` points into the fixture, never at the machine running the test.
//!
//! A `Sysroot` can record what it read; `doctor --bundle` saves those raw files next to the
//! snapshot so that a support engineer sees exactly what the agent saw.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

/// Files larger than this are read only up to it: sysfs and procfs attributes are tiny, and a
/// fixture (or a hostile tree) must not make the agent allocate without bound.
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// Opens `path` for reading only if it is a regular file. It is opened non-blocking, so a FIFO
/// planted where a file should be (`/proc/uptime` in a tree, a token, a drop-in) is refused at
/// once instead of hanging the agent until a writer comes, and a character device (`/dev/zero`
/// as a token) is refused instead of read without end. `nofollow`: a symlink in the last
/// component is refused too (`O_NOFOLLOW`), for files that root opens in a directory another
/// user can write.
pub fn open_regular(path: &Path, nofollow: bool) -> io::Result<(File, fs::Metadata)> {
    let mut options = fs::OpenOptions::new();
    options.read(true);
    checked_open(&options, path, nofollow)
}

/// `open_regular` for writing, never through a symlink in the last component: created with
/// `mode` when missing; appended to (`append`, a log) or opened to read and write without
/// truncating (a lock file). For files root writes in a directory another user can write.
pub fn open_regular_rw(path: &Path, append: bool, mode: u32) -> io::Result<File> {
    let mut options = fs::OpenOptions::new();
    options.read(!append).write(!append).append(append).create(true).truncate(false).mode(mode);
    checked_open(&options, path, true).map(|(f, _)| f)
}

/// Opens with `options`, non-blocking and (`nofollow`) without following a last-component
/// symlink, and keeps the file only if it is a regular one.
fn checked_open(options: &fs::OpenOptions, path: &Path, nofollow: bool) -> io::Result<(File, fs::Metadata)> {
    let flags = libc::O_NONBLOCK | libc::O_CLOEXEC | if nofollow { libc::O_NOFOLLOW } else { 0 };
    let mut options = options.clone();
    let file = options.custom_flags(flags).open(path).map_err(|e| {
        if nofollow && e.raw_os_error() == Some(libc::ELOOP) {
            io::Error::new(io::ErrorKind::InvalidInput, "is a symbolic link; refusing to follow it")
        } else {
            e
        }
    })?;
    let meta = file.metadata()?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let what = if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_char_device() {
            "a character device"
        } else if ft.is_block_device() {
            "a block device"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("is {what}, not a regular file")));
    }
    Ok((file, meta))
}

/// Reads a regular file (see `open_regular`) of at most `max` bytes; a larger one is an error,
/// not a silent truncation.
pub fn read_regular(path: &Path, nofollow: bool, max: u64) -> io::Result<Vec<u8>> {
    let (file, _) = open_regular(path, nofollow)?;
    let mut buf = Vec::new();
    file.take(max + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("is larger than {max} bytes")));
    }
    Ok(buf)
}

/// How many symlinks one lookup may follow before it is declared a loop (as Linux's ELOOP).
const MAX_SYMLINK_HOPS: usize = 40;

/// What a recording `Sysroot` saw, in the order it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    File { path: String, contents: Vec<u8> },
    Link { path: String, target: String },
}

/// Linux include/uapi/linux/vm_sockets.h: `#define IOCTL_VM_SOCKETS_GET_LOCAL_CID _IO(7, 0xb9)`
/// (`_IO(type, nr)` is `type << 8 | nr`: no size, no direction bits; asm-generic/ioctl.h).
pub const IOCTL_VM_SOCKETS_GET_LOCAL_CID: libc::c_ulong = (7 << 8) | 0xb9;

/// The CID the vsock device at `path` answers (`VMADDR_CID_ANY` when no guest transport is
/// loaded). For the live machine only: `Sysroot::read_vsock_cid` decides when that is.
pub fn local_cid(path: &Path) -> io::Result<Option<u32>> {
    let file = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut cid: libc::c_uint = 0;
    // SAFETY: the descriptor is open for the call's length; the request writes one unsigned int
    // (vm_sockets.h: "the CID is returned in an unsigned int") into `cid`, which outlives it.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            IOCTL_VM_SOCKETS_GET_LOCAL_CID as _,
            &mut cid as *mut libc::c_uint,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cid != libc::VMADDR_CID_ANY).then_some(cid))
}

#[derive(Debug)]
pub struct Sysroot {
    root: PathBuf,
    recording: Option<Mutex<Vec<Recorded>>>,
    /// What each path `resolve` looked at was (`cached`): absent, not a link, or a link to its
    /// target. A service snapshot resolves the same sysfs prefixes thousands of times.
    seen: Option<Mutex<std::collections::HashMap<PathBuf, Option<Option<PathBuf>>>>>,
}

/// `resolve`'s look at one path: None when it is not there, else its link target if a link.
type Seen = Option<Option<PathBuf>>;

/// An I/O error that names the file it happened on (relative to the root, as the user would
/// type it after `--sysroot`).
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct PathError {
    pub path: String,
    #[source]
    pub source: io::Error,
}

impl PathError {
    pub fn is_not_found(&self) -> bool {
        self.source.kind() == io::ErrorKind::NotFound
    }
}

impl Sysroot {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysroot { root: root.into(), recording: None, seen: None }
    }

    /// A `Sysroot` that keeps a copy of every file and link it reads, for bundles.
    pub fn recording(root: impl Into<PathBuf>) -> Self {
        Sysroot { root: root.into(), recording: Some(Mutex::new(Vec::new())), seen: None }
    }

    /// This `Sysroot`, remembering what each path component it resolves is, for its whole life:
    /// for one snapshot's reading (a service snapshot resolved the same sysfs prefixes about two
    /// thousand times, a `statx` each: strace), never for anything that writes or waits for a
    /// path to appear.
    pub fn cached(mut self) -> Self {
        self.seen = Some(Mutex::new(Default::default()));
        self
    }

    /// What `here` is (`Seen`), looked at once per `cached` life.
    fn look(&self, here: &Path) -> io::Result<Seen> {
        if let Some(hit) = self.seen.as_ref().and_then(|m| m.lock().ok()?.get(here).cloned()) {
            return Ok(hit);
        }
        let seen = match fs::symlink_metadata(here) {
            Err(_) => None,
            Ok(meta) if meta.file_type().is_symlink() => Some(Some(fs::read_link(here)?)),
            Ok(_) => Some(None),
        };
        if let Some(Ok(mut m)) = self.seen.as_ref().map(|m| m.lock()) {
            m.insert(here.to_path_buf(), seen.clone());
        }
        Ok(seen)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// True when this is the machine's own `/`: the only case in which live-only sources
    /// (a character device `/dev/kmsg`, the journal) are used.
    pub fn is_live(&self) -> bool {
        self.root == Path::new("/")
    }

    /// The path as a user would write it: `/etc/os-release`, whatever the root.
    pub fn display(rel: &str) -> String {
        format!("/{}", rel.trim_start_matches('/'))
    }

    /// Where `rel` is on this machine, without following any symlink.
    pub fn host_path(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    /// Where `rel` is on this machine with every symlink resolved inside the root.
    pub fn resolve(&self, rel: &str) -> Result<PathBuf, PathError> {
        let err = |source| PathError { path: Self::display(rel), source };
        let mut pending: Vec<String> = components(rel);
        pending.reverse();
        let mut resolved: Vec<String> = Vec::new();
        let mut hops = 0;
        while let Some(part) = pending.pop() {
            match part.as_str() {
                "." => continue,
                ".." => {
                    resolved.pop();
                    continue;
                }
                _ => {}
            }
            resolved.push(part);
            let here = self.root.join(resolved.join("/"));
            let Some(link) = self.look(&here).map_err(err)? else {
                // A missing component: the rest cannot resolve either; report it as absent.
                return Err(err(io::Error::from_raw_os_error(libc::ENOENT)));
            };
            if let Some(target) = link {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(err(io::Error::other("too many levels of symbolic links")));
                }
                resolved.pop();
                if target.is_absolute() {
                    resolved.clear();
                }
                let mut target_parts = components(&target.to_string_lossy());
                target_parts.reverse();
                pending.extend(target_parts);
            }
        }
        Ok(self.root.join(resolved.join("/")))
    }

    pub fn exists(&self, rel: &str) -> bool {
        self.resolve(rel).is_ok()
    }

    /// Reads a file as bytes, at most `MAX_FILE_BYTES`.
    pub fn read_bytes(&self, rel: &str) -> Result<Vec<u8>, PathError> {
        let buf = self.read_bytes_unrecorded(rel)?;
        self.record(Recorded::File { path: rel.to_string(), contents: buf.clone() });
        Ok(buf)
    }

    /// As `read_bytes`, but kept out of a bundle's recording: for a reader that looks at many
    /// files to find the few that matter (every process's state) and reads those again.
    pub fn read_bytes_unrecorded(&self, rel: &str) -> Result<Vec<u8>, PathError> {
        let err = |source| PathError { path: Self::display(rel), source };
        let path = self.resolve(rel)?;
        let (file, _) = open_regular(&path, false).map_err(err)?;
        let mut buf = Vec::new();
        file.take(MAX_FILE_BYTES).read_to_end(&mut buf).map_err(err)?;
        Ok(buf)
    }

    /// Reads a text file; bytes that are not UTF-8 become U+FFFD rather than an error, since a
    /// half-readable `os-release` still says more than none.
    pub fn read_string(&self, rel: &str) -> Result<String, PathError> {
        self.read_bytes(rel).map(|b| String::from_utf8_lossy(&b).into_owned())
    }

    /// Reads a one-line attribute (sysfs style) and trims it.
    pub fn read_attr(&self, rel: &str) -> Result<String, PathError> {
        self.read_string(rel).map(|s| s.trim().to_string())
    }

    /// The final name of a symlink's target (`driver -> ../../bus/pci/drivers/nvidia` gives
    /// `nvidia`). `Ok(None)` when there is no link.
    pub fn link_name(&self, rel: &str) -> Result<Option<String>, PathError> {
        Ok(self.link_target(rel)?.and_then(|t| Path::new(&t).file_name().map(|n| n.to_string_lossy().into_owned())))
    }

    /// A symlink's whole target as written (`/proc/42/fd/3 -> /dev/nvidia0`); `Ok(None)` when
    /// there is no link.
    pub fn link_target(&self, rel: &str) -> Result<Option<String>, PathError> {
        let rel_path = Path::new(rel.trim_start_matches('/'));
        let (Some(parent), Some(name)) = (rel_path.parent(), rel_path.file_name()) else {
            return Ok(None);
        };
        let parent = match self.resolve(&parent.to_string_lossy()) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        match fs::read_link(parent.join(name)) {
            Ok(target) => {
                let target = target.to_string_lossy().into_owned();
                self.record(Recorded::Link { path: rel.to_string(), target: target.clone() });
                Ok(Some(target))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(PathError { path: Self::display(rel), source }),
        }
    }

    /// Names in a directory, sorted so that output and tests are stable.
    pub fn list_dir(&self, rel: &str) -> Result<Vec<String>, PathError> {
        let err = |source| PathError { path: Self::display(rel), source };
        let path = self.resolve(rel)?;
        let mut names = Vec::new();
        for entry in fs::read_dir(&path).map_err(err)? {
            let entry = entry.map_err(err)?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    /// Reads the kernel log: a live `/dev/kmsg` is a character device that hands out one
    /// record per read and would block at the end, so it is opened non-blocking and read until
    /// `EAGAIN`; in a fixture or bundle it is a plain file of the same records, one per line.
    pub fn read_kmsg(&self, rel: &str) -> Result<String, PathError> {
        let err = |source| PathError { path: Self::display(rel), source };
        let path = self.resolve(rel)?;
        let meta = fs::metadata(&path).map_err(err)?;
        if !meta.file_type().is_char_device() {
            return self.read_string(rel);
        }
        let mut file = fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&path).map_err(err)?;
        let mut out = String::new();
        // One record is at most about 8 KiB (PRINTK_MESSAGE_MAX is 2 KiB of text plus escapes).
        let mut record = vec![0u8; 16 * 1024];
        loop {
            match file.read(&mut record) {
                Ok(0) => break,
                Ok(n) => {
                    out.push_str(&String::from_utf8_lossy(&record[..n]));
                    if !out.ends_with('\n') {
                        out.push('\n');
                    }
                    if out.len() as u64 > MAX_FILE_BYTES {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // EPIPE: the ring buffer overwrote the record we were about to read; the next
                // read continues at the oldest record still there.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => return Err(err(source)),
            }
        }
        self.record(Recorded::File { path: rel.to_string(), contents: out.clone().into_bytes() });
        Ok(out)
    }

    /// The vsock device's local CID (`/dev/vsock` is `rel`): on the live machine a character
    /// device asked with `IOCTL_VM_SOCKETS_GET_LOCAL_CID`; in a fixture or bundle a plain file
    /// holding the CID as text, or `none`. `Ok(None)`: no device, or a device with no guest
    /// transport behind it (the kernel answers `VMADDR_CID_ANY`, vm_sockets.h).
    pub fn read_vsock_cid(&self, rel: &str) -> Result<Option<u32>, PathError> {
        let err = |source| PathError { path: Self::display(rel), source };
        let path = match self.resolve(rel) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        let meta = fs::metadata(&path).map_err(err)?;
        let cid = if meta.file_type().is_char_device() {
            local_cid(&path).map_err(err)?
        } else {
            let text = self.read_attr(rel)?;
            match text.as_str() {
                "none" => None,
                t => Some(t.parse::<u32>().map_err(|_| {
                    err(io::Error::new(io::ErrorKind::InvalidData, format!("{t:?} is neither a CID nor \"none\"")))
                })?),
            }
        };
        let cid = cid.filter(|c| *c != libc::VMADDR_CID_ANY);
        let text = cid.map_or("none".to_string(), |c| c.to_string());
        self.record(Recorded::File { path: rel.to_string(), contents: format!("{text}\n").into_bytes() });
        Ok(cid)
    }

    /// Everything read so far, when recording.
    pub fn recorded(&self) -> Vec<Recorded> {
        match &self.recording {
            Some(m) => m.lock().map(|v| v.clone()).unwrap_or_else(|p| p.into_inner().clone()),
            None => Vec::new(),
        }
    }

    fn record(&self, item: Recorded) {
        if let Some(m) = &self.recording {
            let mut v = m.lock().unwrap_or_else(|p| p.into_inner());
            v.push(item);
        }
    }
}

/// The normal components of a path as strings, dropping the root and `.`; `..` is kept so
/// that `resolve` can pop, but never above the root.
fn components(path: &str) -> Vec<String> {
    Path::new(path)
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            Component::ParentDir => Some("..".to_string()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vsock_cid_from_a_fixture_file_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let root = Sysroot::recording(dir.path());
        assert_eq!(root.read_vsock_cid("dev/vsock").unwrap(), None, "no file: no device");
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        std::fs::write(dir.path().join("dev/vsock"), "3\n").unwrap();
        assert_eq!(root.read_vsock_cid("dev/vsock").unwrap(), Some(3));
        std::fs::write(dir.path().join("dev/vsock"), "none\n").unwrap();
        assert_eq!(root.read_vsock_cid("dev/vsock").unwrap(), None);
        std::fs::write(dir.path().join("dev/vsock"), "4294967295\n").unwrap();
        assert_eq!(root.read_vsock_cid("dev/vsock").unwrap(), None, "VMADDR_CID_ANY: no guest transport");
        std::fs::write(dir.path().join("dev/vsock"), "three\n").unwrap();
        let e = root.read_vsock_cid("dev/vsock").unwrap_err().to_string();
        assert!(e.starts_with("/dev/vsock: ") && e.contains("\"three\""), "{e}");
        // A bundle keeps what was read, in the fixture's form.
        assert!(root
            .recorded()
            .iter()
            .any(|r| matches!(r, Recorded::File { path, contents } if path == "dev/vsock" && contents == b"3\n")));
    }

    /// The live device, where this machine has one: the ioctl answers a guest CID (3 and up:
    /// 0 to 2 are the hypervisor, local and host, vm_sockets.h) or no transport.
    #[test]
    fn the_live_vsock_device_answers_the_ioctl() {
        let live = Sysroot::new("/");
        match std::fs::metadata("/dev/vsock") {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_char_device(&m.file_type()) => {
                match live.read_vsock_cid("dev/vsock") {
                    Ok(Some(cid)) => assert!(cid >= 3, "{cid}"),
                    Ok(None) => {}
                    Err(e) => assert_eq!(e.source.raw_os_error(), Some(libc::EACCES), "{e}"),
                }
            }
            _ => eprintln!("this machine has no /dev/vsock: only the fixture form is tested"),
        }
    }
    use std::os::unix::fs::symlink;

    #[test]
    fn a_fifo_or_a_device_where_a_file_should_be_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc")).unwrap();
        let fifo = dir.path().join("proc/uptime");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let root = Sysroot::new(dir.path());
        let e = root.read_string("/proc/uptime").unwrap_err();
        assert!(e.to_string().contains("/proc/uptime") && e.to_string().contains("FIFO"), "{e}");
        let e = read_regular(Path::new("/dev/zero"), true, 64).unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        std::fs::write(dir.path().join("big"), [b'x'; 100]).unwrap();
        assert!(read_regular(&dir.path().join("big"), true, 99).unwrap_err().to_string().contains("larger than 99"));
        assert_eq!(read_regular(&dir.path().join("big"), true, 100).unwrap().len(), 100);
        std::os::unix::fs::symlink(dir.path().join("big"), dir.path().join("link")).unwrap();
        assert!(read_regular(&dir.path().join("link"), true, 100).unwrap_err().to_string().contains("symbolic link"));
        assert_eq!(read_regular(&dir.path().join("link"), false, 100).unwrap().len(), 100);
    }

    #[test]
    fn absolute_links_stay_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("usr/src/linux-headers-6.1.0")).unwrap();
        fs::write(root.join("usr/src/linux-headers-6.1.0/Makefile"), "all:\n").unwrap();
        fs::create_dir_all(root.join("lib/modules/6.1.0")).unwrap();
        symlink("/usr/src/linux-headers-6.1.0", root.join("lib/modules/6.1.0/build")).unwrap();
        let s = Sysroot::new(root);
        assert!(s.exists("lib/modules/6.1.0/build/Makefile"));
        assert_eq!(s.read_string("lib/modules/6.1.0/build/Makefile").unwrap(), "all:\n");
    }

    #[test]
    fn dotdot_cannot_escape_the_root() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("etc")).unwrap();
        fs::write(dir.path().join("etc/hostname"), "inside").unwrap();
        let s = Sysroot::new(dir.path());
        assert_eq!(s.read_string("../../../../etc/hostname").unwrap(), "inside");
    }

    #[test]
    fn symlink_loops_are_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        symlink("b", dir.path().join("a")).unwrap();
        symlink("a", dir.path().join("b")).unwrap();
        let e = Sysroot::new(dir.path()).read_string("a").unwrap_err();
        assert!(e.to_string().starts_with("/a: "), "{e}");
    }

    /// A cached `Sysroot` resolves as an uncached one does — links absolute and relative, loops,
    /// escapes — and looks at each path once in its life: a link changed after it was looked
    /// at is not seen by it, and is by a new one (the next snapshot's).
    #[test]
    fn a_cached_sysroot_resolves_alike_and_looks_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir_all(d.join("sys/devices/pci0000:00/0000:18:00.0")).unwrap();
        fs::create_dir_all(d.join("sys/bus/pci/devices")).unwrap();
        fs::write(d.join("sys/devices/pci0000:00/0000:18:00.0/vendor"), "0x10de\n").unwrap();
        symlink("../../../devices/pci0000:00/0000:18:00.0", d.join("sys/bus/pci/devices/0000:18:00.0")).unwrap();
        symlink("/sys/devices", d.join("abs")).unwrap();
        symlink("loop", d.join("loop")).unwrap();
        let (plain, cached) = (Sysroot::new(d), Sysroot::new(d).cached());
        for rel in [
            "sys/bus/pci/devices/0000:18:00.0/vendor",
            "abs/pci0000:00/0000:18:00.0/vendor",
            "../../sys/bus/pci/devices/0000:18:00.0/vendor",
            "sys/bus/pci/devices/0000:19:00.0/vendor",
            "loop",
        ] {
            for _ in 0..2 {
                assert_eq!(
                    cached.resolve(rel).map_err(|e| e.to_string()),
                    plain.resolve(rel).map_err(|e| e.to_string()),
                    "{rel}"
                );
            }
        }
        fs::remove_file(d.join("sys/bus/pci/devices/0000:18:00.0")).unwrap();
        assert!(cached.resolve("sys/bus/pci/devices/0000:18:00.0/vendor").is_ok(), "looked at once");
        assert!(Sysroot::new(d).cached().resolve("sys/bus/pci/devices/0000:18:00.0/vendor").is_err());
    }

    #[test]
    fn errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let e = Sysroot::new(dir.path()).read_string("etc/os-release").unwrap_err();
        assert!(e.is_not_found());
        assert!(e.to_string().starts_with("/etc/os-release: "), "{e}");
    }

    #[test]
    fn recording_keeps_files_and_links() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("f"), "x").unwrap();
        symlink("../drivers/nvidia", dir.path().join("driver")).unwrap();
        let s = Sysroot::recording(dir.path());
        s.read_string("f").unwrap();
        assert_eq!(s.link_name("driver").unwrap().as_deref(), Some("nvidia"));
        assert_eq!(s.link_name("nolink").unwrap(), None);
        assert_eq!(s.recorded().len(), 2);
    }
}
