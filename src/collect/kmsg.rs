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

/// How often a follower looks for new records (and for being stopped): our choice, well under
/// the service's 10-second Xid window so an SXid is judged within a second of its line.
const FOLLOW_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Follows the kernel log from the moment it starts, on a thread of its own, and hands every
/// SXid report to `deliver` as the driver writes it (NVML reports Xids as events, but nothing
/// reports SXids except the kernel log). A live `/dev/kmsg` is read from its end: the kernel
/// documents `SEEK_END` on it as "seek after the last record", from which reads return new
/// records one per `read` (Documentation/ABI/testing/dev-kmsg); a regular file standing for it
/// (a fixture, a test) is read as it grows. Dropping the follower stops the thread within one
/// poll; so does `deliver` answering false.
pub struct Follower {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Follower {
    pub fn start(
        root: &Sysroot,
        mut deliver: impl FnMut(SxidEvent) -> bool + Send + 'static,
    ) -> std::io::Result<Follower> {
        use std::io::{Read, Seek, SeekFrom};
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        use std::sync::atomic::Ordering;
        let path = root.resolve("dev/kmsg").map_err(|e| std::io::Error::new(e.source.kind(), e.to_string()))?;
        let device = std::fs::metadata(&path)?.file_type().is_char_device();
        let mut file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&path)?;
        let mut offset = file.seek(SeekFrom::End(0))?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new().name("kmsg-follow".into()).spawn(move || {
            let mut pending = String::new();
            // One record is at most about 8 KiB (see Sysroot::read_kmsg).
            let mut buf = vec![0u8; 16 * 1024];
            let mut hand_over = |line: &str| -> bool {
                let Some(rec) = parse_record(line) else { return true };
                let Some(mut sxid) = parse_sxid(rec.message) else { return true };
                sxid.usec = rec.usec;
                sxid.seq = rec.seq;
                deliver(sxid)
            };
            while !stopped.load(Ordering::Relaxed) {
                if device {
                    use std::os::fd::AsRawFd;
                    let mut fd = libc::pollfd { fd: file.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd for a descriptor this thread owns, count 1.
                    let ready = unsafe { libc::poll(&mut fd, 1, FOLLOW_POLL.as_millis() as i32) };
                    if ready <= 0 {
                        continue;
                    }
                    match file.read(&mut buf) {
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
                    std::thread::sleep(FOLLOW_POLL);
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
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
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
    pub message: &'a str,
}

/// `6,3964,206764307,-;nvidia-nvswitch2: open (major=510)` → seq 3964, usec 206764307.
/// `[Sun Feb 23 16:24:18 2025] NVRM: …` (dmesg -T) → message only. Continuation lines of
/// kmsg (` SUBSYSTEM=pci`) are not records: `None`.
pub fn parse_record(line: &str) -> Option<Record<'_>> {
    if line.starts_with(' ') || line.trim().is_empty() {
        return None;
    }
    if let Some((header, message)) = line.split_once(';') {
        let fields: Vec<&str> = header.split(',').collect();
        if fields.len() >= 4 && fields[..3].iter().all(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit())) {
            return Some(Record { seq: fields[1].parse().ok(), usec: fields[2].parse().ok(), message });
        }
    }
    if let Some(rest) = line.strip_prefix('[') {
        if let Some((_, message)) = rest.split_once("] ") {
            return Some(Record { seq: None, usec: None, message });
        }
    }
    Some(Record { seq: None, usec: None, message: line })
}

pub fn parse(text: &str, source: &str) -> KernelLog {
    let mut log = KernelLog { source: source.to_string(), ..KernelLog::default() };
    for line in text.lines() {
        let Some(rec) = parse_record(line) else { continue };
        log.records += 1;
        if rec.seq.is_none() && !line.starts_with('[') {
            log.malformed += 1;
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
        }
    }
    log
}

/// `NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout …` →
/// (`0000:9b:00`, `119`, `pid=2024380, …`). Older drivers omit `PCI:`.
pub fn parse_xid(msg: &str) -> Option<(String, &str, &str)> {
    let after = &msg[msg.find("NVRM: Xid (")? + "NVRM: Xid (".len()..];
    let (addr, rest) = after.split_once("): ")?;
    let addr = addr.strip_prefix("PCI:").unwrap_or(addr).to_ascii_lowercase();
    let (code, rest) = rest.split_once(',').unwrap_or((rest, ""));
    let code = code.trim();
    if code.is_empty() || !code.bytes().all(|b| b.is_ascii_digit()) || addr.is_empty() {
        return None;
    }
    Some((addr, code, rest))
}

/// `nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV
/// error (First)` → an SXid report. In NVIDIA/open-gpu-kernel-modules the NVSwitch driver prints
/// `nvidia-<name>: SXid (PCI:<address>): %05d, ` before every SXid line
/// (`src/common/nvswitch/kernel/inc/common_nvswitch.h`, `NVSWITCH_PRINT_SXID`); a report goes
/// on with `Fatal, Link %02d …` or `Non-fatal, Link %02d …` (`inc/error_nvswitch.h`,
/// `NVSWITCH_REPORT_FATAL`/`_NONFATAL`), and the lines of detail printed after it for the same
/// error (`Severity %d Engine instance …`, `Data {…}`; `error_nvswitch.c`,
/// `_nvswitch_dump_error_entry`) are not reports: `None`.
pub fn parse_sxid(msg: &str) -> Option<SxidEvent> {
    let at = msg.find(": SXid (")?;
    let device = msg[..at].rsplit(' ').next()?.trim_start_matches("nvidia-").to_string();
    let after = &msg[at + ": SXid (".len()..];
    let (addr, rest) = after.split_once("): ")?;
    let pci = addr.strip_prefix("PCI:").unwrap_or(addr).to_ascii_lowercase();
    let (code, rest) = rest.split_once(',')?;
    let code = code.trim();
    if code.is_empty() || !code.bytes().all(|b| b.is_ascii_digit()) || pci.is_empty() || device.is_empty() {
        return None;
    }
    let rest = rest.trim_start();
    let (word, tail) = rest.split_once(',').unwrap_or((rest, ""));
    let fatal = match word.trim() {
        "Fatal" => true,
        "Non-fatal" => false,
        _ => return None,
    };
    let tail = tail.trim();
    let link = tail.strip_prefix("Link ").and_then(|l| l.split_whitespace().next()).and_then(|n| n.parse().ok());
    Some(SxidEvent {
        device,
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
/// needs was not assigned (open-gpu-kernel-modules `nv_pci_validate_bars`).
pub fn parse_bar_error(msg: &str) -> Option<BarError> {
    let after = &msg[msg.find("NVRM: BAR")? + "NVRM: BAR".len()..];
    let (bar, rest) = after.split_once(" is ")?;
    let (size, rest) = rest.split_once("M @ 0x")?;
    let (addr, rest) = rest.split_once(" (PCI:")?;
    let pci = rest.strip_suffix(')').unwrap_or(rest).trim().to_ascii_lowercase();
    Some(BarError {
        pci,
        bar: bar.trim().parse().ok()?,
        size_mib: size.trim().parse().ok()?,
        address: u64::from_str_radix(addr.trim(), 16).ok()?,
        message: msg.trim().to_string(),
    })
}

/// `NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-b600-ac93-3616-d754b23d636d`
pub fn parse_gpu_uuid(msg: &str) -> Option<GpuUuidLine> {
    let after = &msg[msg.find("NVRM: GPU at PCI:")? + "NVRM: GPU at PCI:".len()..];
    let (pci, uuid) = after.split_once(": ")?;
    let uuid = uuid.trim();
    uuid.starts_with("GPU-").then(|| GpuUuidLine { pci: pci.to_ascii_lowercase(), uuid: uuid.to_string() })
}

#[cfg(test)]
mod tests {
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
        let s = parse_sxid(
            "[131453.740743] nvidia-nvswitch0: SXid (PCI:0000:00:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        )
        .unwrap();
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
        let got = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the appended SXid");
        assert_eq!((got.sxid, got.fatal, got.seq), (Some(12028), false, Some(2)));
        assert_eq!(got.message, "Link 32 egress non-posted PRIV error (First)");
        assert!(rx.recv_timeout(FOLLOW_POLL * 3).is_err(), "nothing else is a report");
        drop(follower);
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
