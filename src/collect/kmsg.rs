//! The kernel log: `/dev/kmsg` records (`prio,seq,usec,flags;message`), or `dmesg -T` text, and
//! the NVIDIA lines in it that matter: Xid reports, NVSwitch SXid reports, invalid-BAR messages,
//! and the lines that tie a PCI address to a GPU UUID.

use crate::snapshot::{BarError, Fact, GpuUuidLine, KernelLog, SxidEvent, XidEvent};
use crate::sysroot::Sysroot;

pub fn read(root: &Sysroot) -> Fact<KernelLog> {
    match root.read_kmsg("dev/kmsg") {
        Ok(text) => Fact::Value(parse(&text, "/dev/kmsg")),
        Err(e) if e.source.kind() == std::io::ErrorKind::PermissionDenied => {
            Fact::Error(format!("{e} (reading the kernel log needs root or CAP_SYSLOG)"))
        }
        Err(e) => Fact::Error(e.to_string()),
    }
}

/// How often a follower looks for new records when the kernel cannot tell it (a regular file
/// standing for /dev/kmsg where inotify is not available): our choice, well under the service's
/// 10-second Xid window so an SXid is judged within a second of its line. A live /dev/kmsg wakes
/// the follower itself (poll(2) on it is readable when a record is there), and a regular file
/// through inotify's IN_MODIFY (inotify(7)); a follower at rest is asleep in poll(2).
const FOLLOW_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Follows the kernel log from the moment it starts, on a thread of its own, and hands every
/// SXid report to `deliver` as the driver writes it (NVML reports Xids as events, but nothing
/// reports SXids except the kernel log). A live `/dev/kmsg` is read from its end: the kernel
/// documents `SEEK_END` on it as "seek after the last record", from which reads return new
/// records one per `read` (Documentation/ABI/testing/dev-kmsg); a regular file standing for it
/// (a fixture, a test) is read as it grows. The thread sleeps in poll(2) until there is
/// something to read or it is stopped: dropping the follower wakes it through an eventfd(2) and
/// waits for it; so does `deliver` answering false.
pub struct Follower {
    stop: std::os::fd::OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// An eventfd (eventfd(2)): the follower's stop, which poll(2) sees as readable once written.
fn eventfd() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: eventfd takes no pointers; a non-negative return is a new descriptor we own.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// An inotify descriptor watching `path` for writes and truncation (IN_MODIFY, inotify(7)), or
/// `None` where inotify is not available (the follower then looks every `FOLLOW_POLL`).
fn watch_modify(path: &std::path::Path) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: inotify_init1 takes no pointers; a non-negative return is a descriptor we own.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by inotify_init1 and is owned by nobody else.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: a valid inotify descriptor and a NUL-terminated path that outlives the call.
    let wd = unsafe { libc::inotify_add_watch(fd, c_path.as_ptr(), libc::IN_MODIFY) };
    (wd >= 0).then_some(owned)
}

/// Sleeps until `source` is readable or `stop` is written, or `timeout` passes (`None`: no
/// timeout). True when stopped.
fn wait(
    source: Option<std::os::fd::BorrowedFd<'_>>,
    stop: std::os::fd::BorrowedFd<'_>,
    timeout: Option<std::time::Duration>,
) -> bool {
    use std::os::fd::AsRawFd;
    let mut fds = [
        libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        // A negative descriptor is ignored by poll(2).
        libc::pollfd { fd: source.map_or(-1, |f| f.as_raw_fd()), events: libc::POLLIN, revents: 0 },
    ];
    let ms = timeout.map_or(-1, |t| t.as_millis() as i32);
    // SAFETY: two valid pollfds in an array this frame owns, count 2.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    ready > 0 && fds[0].revents != 0
}

/// Reads and forgets what is waiting on a non-blocking descriptor (inotify's events: the
/// follower only needs to know that the file changed).
fn drain(fd: std::os::fd::BorrowedFd<'_>) {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 4096];
    // SAFETY: a valid descriptor and a buffer of the length given; it is non-blocking.
    while unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
}

impl Follower {
    pub fn start(
        root: &Sysroot,
        mut deliver: impl FnMut(SxidEvent) -> bool + Send + 'static,
    ) -> std::io::Result<Follower> {
        use std::io::{Read, Seek, SeekFrom};
        use std::os::fd::AsFd;
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        let path = root.resolve("dev/kmsg").map_err(|e| std::io::Error::new(e.source.kind(), e.to_string()))?;
        let device = std::fs::metadata(&path)?.file_type().is_char_device();
        let mut file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&path)?;
        let mut offset = file.seek(SeekFrom::End(0))?;
        let stop = eventfd()?;
        let stopped = stop.try_clone()?;
        let changes = if device { None } else { watch_modify(&path) };
        let thread = std::thread::Builder::new().name("kmsg-follow".into()).spawn(move || {
            let mut pending = String::new();
            // One record is at most about 8 KiB (see Sysroot::read_kmsg).
            let mut buf = vec![0u8; 16 * 1024];
            let mut hand_over = |line: &str| -> bool {
                let Some(rec) = parse_record(line).filter(Record::from_kernel) else { return true };
                let Some(mut sxid) = parse_sxid(rec.message) else { return true };
                sxid.usec = rec.usec;
                sxid.seq = rec.seq;
                deliver(sxid)
            };
            loop {
                if device {
                    if wait(Some(file.as_fd()), stopped.as_fd(), None) {
                        return;
                    }
                    match file.read(&mut buf) {
                        // Readable but empty: not what the ABI describes; wait a beat rather than spin.
                        Ok(0) => std::thread::sleep(FOLLOW_POLL),
                        Ok(n) => {
                            if !hand_over(String::from_utf8_lossy(&buf[..n]).trim_end_matches('\n')) {
                                return;
                            }
                        }
                        // EAGAIN: nothing after all; EPIPE: the ring overwrote the record about
                        // to be read, and the next read goes on at the oldest one still there.
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "the kernel log cannot be followed; SXids will show at each snapshot");
                            return;
                        }
                    }
                } else {
                    let timeout = if changes.is_some() { None } else { Some(FOLLOW_POLL) };
                    if wait(changes.as_ref().map(|c| c.as_fd()), stopped.as_fd(), timeout) {
                        return;
                    }
                    if let Some(c) = &changes {
                        drain(c.as_fd());
                    }
                    let Ok(len) = file.metadata().map(|m| m.len()) else { continue };
                    if len < offset {
                        // Rewritten shorter: follow the new contents from their start.
                        offset = 0;
                        pending.clear();
                    }
                    if len == offset || file.seek(SeekFrom::Start(offset)).is_err() {
                        continue;
                    }
                    let mut chunk = Vec::new();
                    if (&mut file).take(len - offset).read_to_end(&mut chunk).is_err() {
                        continue;
                    }
                    offset += chunk.len() as u64;
                    pending.push_str(&String::from_utf8_lossy(&chunk));
                    while let Some(end) = pending.find('\n') {
                        let line: String = pending.drain(..=end).collect();
                        if !hand_over(line.trim_end_matches('\n')) {
                            return;
                        }
                    }
                }
            }
        })?;
        Ok(Follower { stop, thread: Some(thread) })
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let one = 1u64.to_ne_bytes();
        // SAFETY: our eventfd and an 8-byte buffer, as eventfd(2) requires for a write.
        let _ = unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One kernel log line split into its kmsg header fields (when it has them) and the message.
#[derive(Debug, PartialEq, Eq)]
pub struct Record<'a> {
    pub seq: Option<u64>,
    pub usec: Option<u64>,
    /// Which of the log's forms the line has, and with it who may have written it.
    pub form: Form,
    pub message: &'a str,
}

/// The form of a kernel log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// A /dev/kmsg record, `prio,seq,usec,flags;message`, with the syslog facility of its
    /// priority (`prio >> 3`).
    Kmsg { facility: u64 },
    /// A `dmesg` text line (`[…] message`): a saved capture, which carries no facility.
    Dmesg,
    /// Neither: not a record anyone can vouch for.
    Raw,
}

impl Record<'_> {
    /// Whether the kernel wrote this record, so that a line in it can speak for the driver.
    ///
    /// /dev/kmsg's first field is the syslog priority, `facility << 3 | level`
    /// (Documentation/ABI/testing/dev-kmsg). The kernel's own messages have facility 0
    /// (`LOG_KERN`); a process that writes to /dev/kmsg gets `LOG_USER` (1) unless it names a
    /// facility, and it cannot name 0: kernel/printk/printk.c, `devkmsg_write`: "If no prefix or
    /// no userspace facility is specified, we enforce LOG_USER, to be able to reliably
    /// distinguish kernel-generated messages from userspace-injected ones." A `dmesg` text line
    /// carries no facility; it only comes from a saved capture (the live log is always read from
    /// /dev/kmsg) and is taken as the kernel's. A line of neither form is nobody's.
    pub fn from_kernel(&self) -> bool {
        match self.form {
            Form::Kmsg { facility } => facility == 0,
            Form::Dmesg => true,
            Form::Raw => false,
        }
    }
}

/// `6,3964,206764307,-;nvidia-nvswitch2: open (major=510)` → seq 3964, usec 206764307,
/// facility 0. `[Sun Feb 23 16:24:18 2025] NVRM: …` (dmesg -T) → message only. Continuation
/// lines of kmsg (` SUBSYSTEM=pci`) are not records: `None`.
pub fn parse_record(line: &str) -> Option<Record<'_>> {
    if line.starts_with(' ') || line.trim().is_empty() {
        return None;
    }
    if let Some((header, message)) = line.split_once(';') {
        let fields: Vec<&str> = header.split(',').collect();
        if fields.len() >= 4 && fields[..3].iter().all(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit())) {
            // An absurd priority is no facility the kernel writes: u64::MAX is not 0.
            let facility = fields[0].parse::<u64>().map_or(u64::MAX, |p| p >> 3);
            return Some(Record {
                seq: fields[1].parse().ok(),
                usec: fields[2].parse().ok(),
                form: Form::Kmsg { facility },
                message,
            });
        }
    }
    if let Some(rest) = line.strip_prefix('[') {
        if let Some((_, message)) = rest.split_once("] ") {
            return Some(Record { seq: None, usec: None, form: Form::Dmesg, message });
        }
    }
    Some(Record { seq: None, usec: None, form: Form::Raw, message: line })
}

pub fn parse(text: &str, source: &str) -> KernelLog {
    let mut log = KernelLog { source: source.to_string(), ..KernelLog::default() };
    for line in text.lines() {
        let Some(rec) = parse_record(line) else { continue };
        log.records += 1;
        if rec.form == Form::Raw {
            log.malformed += 1;
        }
        // Only the kernel's records can carry the driver's lines; what a process wrote to
        // /dev/kmsg is not read for them at all.
        if !rec.from_kernel() {
            continue;
        }
        let msg = rec.message;
        if let Some((pci, raw_code, rest)) = parse_xid(msg) {
            log.xids.push(XidEvent {
                pci,
                xid: raw_code.parse().ok(),
                raw_code: raw_code.to_string(),
                usec: rec.usec,
                seq: rec.seq,
                message: rest.trim().to_string(),
            });
        } else if let Some(mut sxid) = parse_sxid(msg) {
            sxid.usec = rec.usec;
            sxid.seq = rec.seq;
            log.sxids.push(sxid);
        } else if let Some(bar) = parse_bar_error(msg) {
            log.bar_errors.push(bar);
        } else if let Some(uuid) = parse_gpu_uuid(msg) {
            if !log.gpu_uuids.contains(&uuid) {
                log.gpu_uuids.push(uuid);
            }
        } else if let Some(mut hung) = parse_hung_task(msg) {
            hung.usec = rec.usec;
            log.hung_tasks.push(hung);
        }
    }
    log
}

// The shapes below are the driver's own format strings, matched from the first character of
// the message to the end of the part that identifies the device: a line merely *containing*
// `NVRM: Xid (` is not one. The kernel logs text that unprivileged users choose (a crashing
// program's name in the segfault line, its 15-character `comm` first), so a looser match lets
// anyone write an Xid (issue 37); none of those lines can start with the whole shape.

/// `INFO: task python3:48211 blocked for more than 122 seconds.`, the kernel's hung-task detector
/// (kernel/hung_task.c, `check_hung_task`: `pr_err("INFO: task %s:%d blocked for more than %ld
/// seconds.\n", t->comm, t->pid, …)`). `comm` is the task's name, up to 15 bytes the process
/// chose, so it may hold `:` itself: the pid is the digits after the last `:` before the fixed
/// tail, which no 15-byte name can contain.
pub fn parse_hung_task(msg: &str) -> Option<crate::snapshot::HungTaskLine> {
    const TAIL: &str = " blocked for more than ";
    let rest = msg.strip_prefix("INFO: task ")?;
    let at = rest.find(TAIL)?;
    let (task, after) = (&rest[..at], &rest[at + TAIL.len()..]);
    let (comm, pid) = task.rsplit_once(':')?;
    if comm.is_empty() || comm.len() > 15 {
        return None;
    }
    let mut c = Cursor(after);
    let seconds = c.digits()?.parse().ok()?;
    c.tag(" seconds.")?;
    // The kernel escapes control bytes in /dev/kmsg, but a bundle's or a fixture's log is text.
    let comm = crate::text::printable(comm).into_owned();
    Some(crate::snapshot::HungTaskLine { comm, pid: pid.parse().ok()?, seconds, usec: None })
}

/// A little reader over the start of a message.
struct Cursor<'a>(&'a str);

impl<'a> Cursor<'a> {
    fn tag(&mut self, t: &str) -> Option<()> {
        self.0 = self.0.strip_prefix(t)?;
        Some(())
    }
    /// `min..=max` characters from `ok`.
    fn run(&mut self, min: usize, max: usize, ok: impl Fn(u8) -> bool) -> Option<&'a str> {
        let n = self.0.bytes().take(max).take_while(|b| ok(*b)).count();
        if n < min {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn hex(&mut self, min: usize, max: usize) -> Option<&'a str> {
        self.run(min, max, |b| b.is_ascii_hexdigit())
    }
    fn digits(&mut self) -> Option<&'a str> {
        self.run(1, usize::MAX, |b| b.is_ascii_digit())
    }
    /// `%04x:%02x:%02x`, the driver's domain:bus:device (a domain wider than 16 bits prints
    /// more digits).
    fn pci(&mut self) -> Option<String> {
        let start = self.0;
        self.hex(4, 8)?;
        self.tag(":")?;
        self.hex(2, 2)?;
        self.tag(":")?;
        self.hex(2, 2)?;
        Some(start[..start.len() - self.0.len()].to_ascii_lowercase())
    }
    /// `%04x:%02x:%02x.%x`, with the function.
    fn pci_function(&mut self) -> Option<String> {
        let start = self.0;
        self.pci()?;
        self.tag(".")?;
        self.hex(1, 1)?;
        Some(start[..start.len() - self.0.len()].to_ascii_lowercase())
    }
}

/// `NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout …` →
/// (`0000:9b:00`, `119`, ` pid=2024380, …`). The driver prints
/// `"NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, %s\n"`, or with ` GPU-I:%02u` (and
/// ` GPU-CI:%02u`) after the address when a MIG instance is attributed
/// (open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/rc/kernel_rc.c, `krcReportXid_IMPL`);
/// older drivers omit `PCI:`. The message must start with it.
pub fn parse_xid(msg: &str) -> Option<(String, &str, &str)> {
    let mut c = Cursor(msg);
    c.tag("NVRM: Xid (")?;
    let _ = c.tag("PCI:");
    let pci = c.pci()?;
    if c.tag(" GPU-I:").is_some() {
        c.digits()?;
        if c.tag(" GPU-CI:").is_some() {
            c.digits()?;
        }
    }
    c.tag("): ")?;
    let code = c.digits()?;
    c.tag(",")?;
    Some((pci, code, c.0))
}

/// `nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV
/// error (First)` → an SXid report. In NVIDIA/open-gpu-kernel-modules the NVSwitch driver prints
/// `nvidia-<name>: SXid (PCI:<address>): %05d, ` before every SXid line
/// (`src/common/nvswitch/kernel/inc/common_nvswitch.h`, `NVSWITCH_PRINT_SXID`, the address as
/// `%04x:%02x:%02x.%x`, the name `nvswitch%d`); a report goes on with `Fatal, Link %02d …` or
/// `Non-fatal, Link %02d …` (`inc/error_nvswitch.h`, `NVSWITCH_REPORT_FATAL`/`_NONFATAL`), and
/// the lines of detail printed after it for the same error (`Severity %d Engine instance …`,
/// `Data {…}`; `error_nvswitch.c`, `_nvswitch_dump_error_entry`) are not reports: `None`. The
/// message must start with it.
pub fn parse_sxid(msg: &str) -> Option<SxidEvent> {
    let mut c = Cursor(msg);
    c.tag("nvidia-nvswitch")?;
    let instance = c.digits()?;
    c.tag(": SXid (PCI:")?;
    let pci = c.pci_function()?;
    c.tag("): ")?;
    let code = c.digits()?;
    c.tag(", ")?;
    let (word, tail) = c.0.split_once(',').unwrap_or((c.0, ""));
    let fatal = match word.trim() {
        "Fatal" => true,
        "Non-fatal" => false,
        _ => return None,
    };
    let tail = tail.trim();
    let link = tail.strip_prefix("Link ").and_then(|l| l.split_whitespace().next()).and_then(|n| n.parse().ok());
    Some(SxidEvent {
        device: format!("nvswitch{instance}"),
        pci,
        sxid: code.parse().ok(),
        raw_code: code.to_string(),
        fatal,
        link,
        usec: None,
        seq: None,
        message: tail.to_string(),
    })
}

/// `NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0)`, printed by the driver when a BAR the GPU
/// needs was not assigned (open-gpu-kernel-modules `nv_pci_validate_bars`:
/// `"NVRM: BAR%d is %dM @ 0x%llx (PCI:%04x:%02x:%02x.%x)\n"`). The whole message is that line.
pub fn parse_bar_error(msg: &str) -> Option<BarError> {
    let mut c = Cursor(msg.trim_end());
    c.tag("NVRM: BAR")?;
    let bar = c.digits()?.parse().ok()?;
    c.tag(" is ")?;
    let size_mib = c.digits()?.parse().ok()?;
    c.tag("M @ 0x")?;
    let address = u64::from_str_radix(c.hex(1, 16)?, 16).ok()?;
    c.tag(" (PCI:")?;
    let pci = c.pci_function()?;
    c.tag(")")?;
    c.0.is_empty().then(|| BarError { pci, bar, size_mib, address, message: msg.trim().to_string() })
}

/// `NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-b600-ac93-3616-d754b23d636d`, printed once per GPU
/// before its first Xid (`"NVRM: GPU at PCI:%04x:%02x:%02x: %s\n"` with the GPU's ASCII GID,
/// kernel_rc.c, `_krcLogUuidOnce`). The whole message is that line.
pub fn parse_gpu_uuid(msg: &str) -> Option<GpuUuidLine> {
    let mut c = Cursor(msg.trim_end());
    c.tag("NVRM: GPU at PCI:")?;
    let pci = c.pci()?;
    c.tag(": ")?;
    let uuid = c.0;
    let mut u = Cursor(uuid);
    u.tag("GPU-")?;
    for (i, n) in [8, 4, 4, 4, 12].into_iter().enumerate() {
        if i > 0 {
            u.tag("-")?;
        }
        u.hex(n, n)?;
    }
    u.0.is_empty().then(|| GpuUuidLine { pci, uuid: uuid.to_string() })
}

#[cfg(test)]
mod tests {

    #[test]
    fn hung_task_reports_in_the_kernels_shape_only() {
        let h = parse_hung_task("INFO: task python3:48211 blocked for more than 122 seconds.").unwrap();
        assert_eq!((h.comm.as_str(), h.pid, h.seconds), ("python3", 48211, 122));
        // A name may hold a colon; the pid is after the last one.
        let h = parse_hung_task("INFO: task a:1 x:77 blocked for more than 241 seconds.").unwrap();
        assert_eq!((h.comm.as_str(), h.pid), ("a:1 x", 77));
        for bad in [
            "INFO: task python3:48211 blocked for more than 122 seconds",
            "INFO: task python3 blocked for more than 122 seconds.",
            "INFO: task :4 blocked for more than 122 seconds.",
            "INFO: task a-name-longer-than-15:4 blocked for more than 122 seconds.",
            "x INFO: task python3:1 blocked for more than 122 seconds.",
        ] {
            assert!(parse_hung_task(bad).is_none(), "{bad}");
        }
    }
    use super::*;
    use proptest::prelude::*;

    const XID_119: &str = include_str!("../../tests/fixtures/captures/dmesg-with-xid-119.log");
    const KMSG: &str = include_str!("../../tests/fixtures/captures/kmsg.1.log");

    #[test]
    fn real_dmesg_with_xid_119() {
        let log = parse(XID_119, "dmesg");
        assert!(log.xids.len() >= 5, "{:?}", log.xids);
        assert!(log.xids.iter().all(|x| x.pci == "0000:9b:00" && x.xid == Some(119)));
        assert!(log.xids[0].message.starts_with("pid=2024380, name=nvidia-smi, Timeout"));
        assert_eq!(log.gpu_uuids[0].uuid, "GPU-509665ad-b600-ac93-3616-d754b23d636d");
        assert_eq!(log.malformed, 0);
    }

    #[test]
    fn real_kmsg_records() {
        let log = parse(KMSG, "/dev/kmsg");
        assert_eq!(log.malformed, 0);
        assert!(log.records > 40);
        assert!(log.xids.is_empty());
        let r = parse_record("6,3964,206764307,-;nvidia-nvswitch2: open (major=510)").unwrap();
        assert_eq!((r.seq, r.usec, r.message), (Some(3964), Some(206764307), "nvidia-nvswitch2: open (major=510)"));
    }

    #[test]
    fn xid_forms() {
        assert_eq!(
            parse_xid("NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
            Some(("0000:0c:00".into(), "79", " pid='<unknown>', name=<unknown>, GPU has fallen off the bus."))
        );
        assert_eq!(parse_xid("NVRM: Xid (0000:03:00): 13, Graphics Exception").map(|x| x.1), Some("13"));
        let absurd = parse_xid("NVRM: Xid (PCI:0000:0c:00): 99999999999999999999999, x").unwrap();
        assert_eq!(absurd.1, "99999999999999999999999");
        assert_eq!(parse_xid("NVRM: Xid (PCI:0000:0c:00): -5, x"), None);
    }

    /// The forms the NVSwitch driver prints (error_nvswitch.h, error_nvswitch.c), with the lines
    /// of detail that follow a report, which must not count as reports of their own.
    #[test]
    fn sxid_reports_and_not_their_detail_lines() {
        let text = "\
4,2001,8123617543,-;nvidia-nvswitch1: SXid (PCI:0000:00:08.0): 11004, Non-fatal, Link 36 ingress invalid ACL (First)
4,2002,8123618226,-;nvidia-nvswitch1: SXid (PCI:0000:00:08.0): 11004, Severity 0 Engine instance 36 Sub-engine instance 00
4,2003,8123619785,-;nvidia-nvswitch1: SXid (PCI:0000:00:08.0): 11004, Data {0x00000008, 0xff9fc39c, 0x00000008, 0xff9fc39c, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}
3,2004,8131453740,-;nvidia-nvswitch0: SXid (PCI:0000:C3:00.0): 24007, Fatal, Link 30 sourcetrack timeout error
";
        let log = parse(text, "/dev/kmsg");
        assert_eq!(log.records, 4);
        assert_eq!(log.sxids.len(), 2, "{:#?}", log.sxids);
        let first = &log.sxids[0];
        assert_eq!(
            (first.device.as_str(), first.pci.as_str(), first.sxid, first.fatal, first.link, first.seq),
            ("nvswitch1", "0000:00:08.0", Some(11004), false, Some(36), Some(2001))
        );
        assert_eq!(first.message, "Link 36 ingress invalid ACL (First)");
        let second = &log.sxids[1];
        assert_eq!(
            (second.pci.as_str(), second.sxid, second.fatal, second.link),
            ("0000:c3:00.0", Some(24007), true, Some(30))
        );
        assert!(log.xids.is_empty());
    }

    #[test]
    fn sxid_forms() {
        // dmesg -T, the example lines leptonai/gpud quotes in its SXid package's comments, a code
        // too big for a u32.
        let s = parse_sxid(
            "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
        )
        .unwrap();
        assert_eq!((s.sxid, s.fatal, s.link), (Some(12028), false, Some(32)));
        let log = parse(
            "[131453.740743] nvidia-nvswitch0: SXid (PCI:0000:00:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
            "dmesg",
        );
        let s = &log.sxids[0];
        assert_eq!((s.device.as_str(), s.sxid, s.fatal), ("nvswitch0", Some(20034), true));
        let s = parse_sxid("nvidia-nvswitch0: SXid (PCI:0000:00:00.0): 99999999999, Fatal, x").unwrap();
        assert_eq!((s.sxid, s.raw_code.as_str()), (None, "99999999999"));
        assert_eq!(parse_sxid("nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): garbled, Fatal"), None);
        assert_eq!(parse_sxid("nvidia-nvswitch2: open (major=510)"), None);
    }

    /// A regular file standing for /dev/kmsg: what was there before the follower started is not
    /// handed over, what is appended after is, one report per SXid (not its detail lines), and
    /// a line written in two pieces is read whole.
    #[test]
    fn the_follower_hands_over_new_sxids_only() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("dev")).unwrap();
        let kmsg = dir.path().join("dev/kmsg");
        std::fs::write(
            &kmsg,
            "4,1,1,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n",
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let follower = Follower::start(&Sysroot::new(dir.path()), move |x| tx.send(x).is_ok()).unwrap();
        let mut f = std::fs::OpenOptions::new().append(true).open(&kmsg).unwrap();
        write!(f, "4,2,2,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress").unwrap();
        f.flush().unwrap();
        std::thread::sleep(FOLLOW_POLL * 2);
        writeln!(f, " non-posted PRIV error (First)").unwrap();
        writeln!(f, "4,3,3,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Severity 0 Engine instance 32 Sub-engine instance 00").unwrap();
        writeln!(f, "4,4,4,-;NVRM: Xid (PCI:0000:0c:00): 13, pid=1, name=x, y").unwrap();
        // A process's record (facility LOG_USER) in the SXid's exact shape: not the driver's.
        writeln!(f, "12,5,5,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Fatal, Link 1 forged").unwrap();
        let got = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the appended SXid");
        assert_eq!((got.sxid, got.fatal, got.seq), (Some(12028), false, Some(2)));
        assert_eq!(got.message, "Link 32 egress non-posted PRIV error (First)");
        assert!(rx.recv_timeout(FOLLOW_POLL * 3).is_err(), "nothing else is a report");
        drop(follower);
    }

    /// What an unprivileged user can put into the kernel log (issue 37): the kernel logs a
    /// crashing program's `comm` (15 characters) first and its file's name after ` in `, and a
    /// process can write records of its own to /dev/kmsg (facility `LOG_USER`, `<14>`). None of
    /// them is an Xid, an SXid, a BAR or a GPU-at line; the driver's own lines still are.
    #[test]
    fn forged_lines_are_not_the_drivers() {
        let forged = "\
4,100,1000,-;NVRM: Xid (PCI:[4242]: segfault at 0 ip 0000000000401000 sp 00007ffd00000000 error 4 in NVRM: Xid (PCI:0000:0c:00): 79, pid=1, name=x, GPU has fallen off the bus.[401000+1000]
6,101,1001,-;a.out[4243]: segfault at 0 ip 0000000000401000 sp 00007ffd00000000 error 4 in NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.[401000+1000]
6,102,1002,-;nvidia-nvswitch[4244]: segfault at 0 ip 0 sp 0 error 4 in nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up[1+1]
12,103,1003,-;NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
14,104,1004,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up
14,105,1005,-;NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0)
14,106,1006,-;NVRM: GPU at PCI:0000:0c:00: GPU-7e1f0b2c-55c4-c1a4-9b33-2f1d0e4c8a71
6,107,1007,-;systemd[1]: Started NVRM: Xid (PCI:0000:0c:00): 79, x.service.
6,108,1008,-;NVRM: Xid (PCI:0000:0c:00)x: 79, y
6,109,1009,-;NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0) and more
6,110,1010,-;NVRM: GPU at PCI:0000:0c:00: GPU-not-a-uuid
NVRM: Xid (PCI:0000:0c:00): 79, a line with no header at all
";
        let log = parse(forged, "/dev/kmsg");
        assert!(log.xids.is_empty(), "{:#?}", log.xids);
        assert!(log.sxids.is_empty(), "{:#?}", log.sxids);
        assert!(log.bar_errors.is_empty(), "{:#?}", log.bar_errors);
        assert!(log.gpu_uuids.is_empty(), "{:#?}", log.gpu_uuids);
        assert_eq!(log.records, 12);

        // The driver's own lines, as its format strings print them, with the kernel's facility
        // (priority 3 and 4: LOG_KERN at err and warning).
        let real = "\
4,200,2000,-;NVRM: Xid (PCI:0000:0c:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
4,201,2001,-;NVRM: Xid (PCI:0000:0d:00 GPU-I:01): 13, pid=48211, name=python3, Graphics Exception
4,202,2002,-;NVRM: Xid (PCI:0000:0e:00 GPU-I:02 GPU-CI:00): 43, pid=48211, name=python3, Ch 00000010
3,203,2003,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up
3,204,2004,-;NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0)
4,205,2005,-;NVRM: GPU at PCI:0000:0c:00: GPU-7e1f0b2c-55c4-c1a4-9b33-2f1d0e4c8a71
";
        let log = parse(real, "/dev/kmsg");
        let xids: Vec<_> = log.xids.iter().map(|x| (x.pci.as_str(), x.xid)).collect();
        assert_eq!(xids, [("0000:0c:00", Some(79)), ("0000:0d:00", Some(13)), ("0000:0e:00", Some(43))]);
        assert_eq!(log.sxids.len(), 1);
        assert_eq!(log.bar_errors.len(), 1);
        assert_eq!(log.gpu_uuids.len(), 1);
    }

    /// The follower keeps the same rule: a process's record is not handed over as an SXid.
    #[test]
    fn record_facility_decides_who_wrote_it() {
        let user = parse_record("14,1,2,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30").unwrap();
        assert_eq!(user.form, Form::Kmsg { facility: 1 });
        assert!(!user.from_kernel());
        let kernel = parse_record("3,1,2,-;x").unwrap();
        assert!(kernel.from_kernel());
        assert!(parse_record("[1.0] x").unwrap().from_kernel(), "a dmesg capture");
        assert!(!parse_record("x").unwrap().from_kernel());
        assert!(!parse_record("99999999999999999999999,1,2,-;x").unwrap().from_kernel());
    }

    #[test]
    fn bar_message() {
        let b = parse_bar_error("NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0a:00.0)").unwrap();
        assert_eq!((b.pci.as_str(), b.bar, b.size_mib, b.address), ("0000:0a:00.0", 1, 0, 0));
    }

    proptest! {
        #[test]
        fn never_panics(s in ".*") {
            let _ = parse(&s, "x");
        }

        #[test]
        fn never_panics_on_nvrm_like_text(s in "((NVRM: (Xid|BAR|GPU at PCI:)|nvidia-nvswitch[0-9]: SXid \\()[ -~]{0,40}\\n){0,5}") {
            let _ = parse(&s, "x");
        }

        #[test]
        fn roundtrips_any_sxid(code in 0u32..100_000, bus in 0u8..=255, fatal: bool, link in 0u32..64) {
            let word = if fatal { "Fatal" } else { "Non-fatal" };
            let line = format!("4,1,2,-;nvidia-nvswitch2: SXid (PCI:0000:{bus:02x}:00.0): {code:05}, {word}, Link {link:02} x");
            let log = parse(&line, "x");
            prop_assert_eq!(log.sxids[0].sxid, Some(code));
            prop_assert_eq!((log.sxids[0].fatal, log.sxids[0].link), (fatal, Some(link)));
            prop_assert_eq!(&log.sxids[0].pci, &format!("0000:{bus:02x}:00.0"));
        }

        #[test]
        fn roundtrips_any_xid(code in 0u32..1000, bus in 0u8..=255) {
            let line = format!("4,1,2,-;NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid=1, name=x, y");
            let log = parse(&line, "x");
            prop_assert_eq!(log.xids[0].xid, Some(code));
            prop_assert_eq!(&log.xids[0].pci, &format!("0000:{bus:02x}:00"));
        }
    }
}
