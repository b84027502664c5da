//! A support bundle the service writes itself when a fatal Xid arrives (from NVML's events, or
//! new in a snapshot's kernel log) or an NVSwitch reports a fatal SXid: the last snapshot and
//! report, the fault history, and NVIDIA's `nvidia-bug-report.log.gz` taken while the fault is
//! fresh (`collect::bug_report`), into `state_dir/bundles/`.
//!
//! Rules:
//! 1. Fatal is the catalog's word: an Xid whose resolution is a GPU reset, a VM restart or a host
//!    reboot (`checks::route::for_resolution`); one that only restarts an application is not.
//!    An SXid is fatal when the Fabric Manager User Guide lists it in its "Fatal" or "Always
//!    Fatal NVSwitch SXid Errors" table (`data/sxid-catalog.tsv`, column `table`); for a code
//!    the guide does not list, the catalog defers to the driver's `Fatal`/`Non-fatal` word on
//!    the kernel log line (that file's header), and so does this. — `fatal_sxid`
//! 2. At most one bundle per `MIN_INTERVAL`, and one at a time: repeats of a fault that needs a
//!    reset say nothing new, and each run walks the whole machine.
//! 3. The newest `KEEP` bundles are kept, older ones removed after each new one.
//! 4. Never on the event task: the script and the writing run on a thread of their own, under the
//!    script's deadline; the event task only starts it. One log line says where the bundle is.
//! 5. A service that stops kills a script still running, and what it started (`Drop`).
//!
//! 6. Who runs NVIDIA's script: the service itself when it is root; the root helper
//!    (`collect::bug_report_helper`) when it is not and the helper is installed, the shipped
//!    case (the unit runs the service as `phq-agent`, and the script refuses any user but root).
//!    Either way the bundle's note says where the log came from, or why there is none.
//!
//! Must not: run the bug report script of a `--sysroot` fixture (`collect::bug_report::collect`
//! keeps that rule), or fail the service: a bundle that cannot be written is a warning.

use crate::checks::route::{for_resolution, Action};
use crate::collect::bug_report::{self, BugReport};
use crate::collect::bug_report_helper::{self, Via};
use crate::report::Report;
use crate::snapshot::Snapshot;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rule 2: a fatal Xid means a reset; within half an hour the same fault (or its cascade on the
/// other GPUs) is what the last bundle already shows.
pub const MIN_INTERVAL: Duration = Duration::from_secs(30 * 60);
/// Rule 3: the last few faults' bundles, each at most `bug_report::MAX_LOG_BYTES` plus the
/// report, so the state directory stays within about a hundred MiB for them.
pub const KEEP: usize = 3;
/// Where, under the state directory.
pub const DIR: &str = "bundles";

/// Rule 1.
pub fn fatal(xid: u64) -> bool {
    let Some(entry) = u32::try_from(xid).ok().and_then(crate::checks::xid::xid) else { return false };
    matches!(for_resolution(entry.immediate.bucket()).0, Action::ResetGpu | Action::RestartVm | Action::RebootHost)
}

/// Rule 1 for an NVSwitch's SXid: `code` as the driver wrote it (`None` when it did not parse),
/// `said_fatal` the line's own word.
pub fn fatal_sxid(code: Option<u32>, said_fatal: bool) -> bool {
    use crate::checks::xid::SxidTable;
    match code.and_then(crate::checks::xid::sxid) {
        Some(row) => matches!(row.table, SxidTable::Fatal | SxidTable::AlwaysFatal),
        None => said_fatal,
    }
}

/// The kernel log's Xids newer than `after` (its sequence number), and `after` moved to the
/// newest: the driver's own record of a fatal Xid reaches a snapshot even when NVML, blocked by
/// the fault, delivers no event. `after` starts at the first snapshot's newest, so what the log
/// held at start makes no bundle.
pub fn new_kernel_xids(s: &Snapshot, after: &mut Option<u64>) -> Vec<(String, u64)> {
    let Some(log) = s.kernel_log.value() else { return vec![] };
    let new: Vec<(String, u64)> = log
        .xids
        .iter()
        .filter(|x| x.seq.is_some_and(|seq| after.is_none_or(|a| seq > a)))
        .filter_map(|x| Some((format!("{}.0", x.pci.to_ascii_lowercase()), u64::from(x.xid?))))
        .collect();
    if let Some(newest) = log.xids.iter().filter_map(|x| x.seq).max() {
        *after = Some(after.map_or(newest, |a| a.max(newest)));
    }
    new
}

/// The event task's handle: when the last bundle began, whether one is being written.
pub struct Bundler {
    state_dir: PathBuf,
    live: bool,
    last: Option<Instant>,
    running: Arc<AtomicBool>,
    /// The running script's process group, killed when the service stops (`Drop`): a script
    /// started by a thread that dies takes a signal itself (`PR_SET_PDEATHSIG`), its children not.
    group: Arc<AtomicI32>,
}

impl Drop for Bundler {
    fn drop(&mut self) {
        bug_report::kill_group(&self.group);
    }
}

impl Bundler {
    /// `live`: the service watches this machine (no `--sysroot`).
    pub fn new(state_dir: PathBuf, live: bool) -> Bundler {
        Bundler {
            state_dir,
            live,
            last: None,
            running: Arc::new(AtomicBool::new(false)),
            group: Arc::new(AtomicI32::new(0)),
        }
    }

    /// Rules 1, 2 and 4: starts a bundle for a fatal Xid unless one was begun within
    /// `MIN_INTERVAL` or is still being written. Whether one was started.
    pub fn on_xid(&mut self, gpu: &str, xid: u64, snapshot: Arc<Snapshot>, report: Arc<Report>) -> bool {
        if !fatal(xid) {
            return false;
        }
        self.start(format!("xid{xid}"), gpu, snapshot, report)
    }

    /// `on_xid` for an NVSwitch's SXid (rule 1's second half): the same bundle, the same limits.
    pub fn on_sxid(
        &mut self,
        nvswitch: &str,
        code: Option<u32>,
        said_fatal: bool,
        snapshot: Arc<Snapshot>,
        report: Arc<Report>,
    ) -> bool {
        let Some(code) = code.filter(|&c| fatal_sxid(Some(c), said_fatal)) else { return false };
        self.start(format!("sxid{code}"), nvswitch, snapshot, report)
    }

    /// `what`: the fault, as the bundle's name begins (`xid79`, `sxid12001`); `device`: whose.
    fn start(&mut self, what: String, device: &str, snapshot: Arc<Snapshot>, report: Arc<Report>) -> bool {
        let now = Instant::now();
        if self.last.is_some_and(|t| now.duration_since(t) < MIN_INTERVAL) || self.running.load(Ordering::Acquire) {
            tracing::info!(%device, fault = %what, "fatal fault: no new support bundle, one was made within {} min", MIN_INTERVAL.as_secs() / 60);
            return false;
        }
        let options = match bug_report::Options::from_env() {
            Ok(o) => bug_report::Options { group: Some(self.group.clone()), ..o },
            Err(e) => {
                tracing::warn!(error = %e, "fatal fault: no support bundle");
                return false;
            }
        };
        let via = match Via::from_env(self.live) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "fatal fault: no support bundle");
                return false;
            }
        };
        self.last = Some(now);
        self.running.store(true, Ordering::Release);
        let (dir, live, running, device) =
            (self.state_dir.join(DIR), self.live, self.running.clone(), device.to_string());
        let state_dir = self.state_dir.clone();
        let started = std::thread::Builder::new().name("fault-bundle".into()).spawn(move || {
            let how = How { options: &options, via: &via, live };
            match write(&dir, &state_dir, &how, &what, &snapshot, &report) {
                Ok((path, note)) => {
                    tracing::warn!(%device, fault = %what, path = %path.display(), bug_report = %note, "fatal fault: support bundle written to {}", path.display())
                }
                Err(e) => tracing::warn!(%device, fault = %what, error = format!("{e:#}"), "fatal fault: the support bundle could not be written"),
            }
            running.store(false, Ordering::Release);
        });
        if let Err(e) = started {
            self.running.store(false, Ordering::Release);
            tracing::warn!(error = %e, "fatal fault: cannot start the support bundle's thread");
            return false;
        }
        true
    }
}

/// How the bug report is taken (rule 6).
struct How<'a> {
    options: &'a bug_report::Options,
    via: &'a Via,
    live: bool,
}

/// One bundle in `dir` (made 0700 when missing), then rule 3. Its path and the bug report's note.
fn write(
    dir: &Path,
    state_dir: &Path,
    how: &How,
    what: &str,
    snapshot: &Snapshot,
    report: &Report,
) -> anyhow::Result<(PathBuf, String)> {
    use anyhow::Context;
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(e).with_context(|| format!("{}: cannot create", dir.display()))
        }
        _ => {}
    }
    let bug: BugReport = match how.via {
        Via::Itself => bug_report::collect(how.options, how.live, dir),
        Via::Helper(helper_dir) => bug_report_helper::ask(
            &state_dir.join(bug_report_helper::REQUEST),
            helper_dir,
            how.options.deadline + bug_report_helper::SLACK,
        ),
    };
    let history = crate::history::History::load(state_dir).ok().filter(|h| !h.faults.is_empty());
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
    let path = dir.join(format!("{what}-{secs}.tar.gz"));
    crate::report::bundle::write(&path, snapshot, report, &[], history.as_ref(), &bug)?;
    prune(dir, KEEP);
    Ok((path, bug.note))
}

/// Rule 3: removes all but the newest `keep` bundles (by the time in their names, then name).
fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut bundles: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let fault = name.strip_prefix("sxid").or_else(|| name.strip_prefix("xid"))?;
            let secs = fault.strip_suffix(".tar.gz")?.split_once('-')?.1.parse().ok()?;
            Some((secs, e.path()))
        })
        .collect();
    bundles.sort();
    let excess = bundles.len().saturating_sub(keep);
    for (_, old) in bundles.into_iter().take(excess) {
        if let Err(e) = std::fs::remove_file(&old) {
            tracing::warn!(path = %old.display(), error = %e, "cannot remove an old support bundle");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatal_is_a_reset_a_vm_restart_or_a_reboot_by_the_catalog() {
        // 79 fallen off the bus (RESTART_BM), 48 double-bit ECC (WORKFLOW_XID_48 → reset),
        // 13 graphics engine exception and 31 page fault (RESTART_APP), 999 not in the catalog.
        assert_eq!([79, 48, 13, 31, 999].map(fatal), [true, true, false, false, false]);
    }

    #[test]
    fn a_fatal_sxid_is_the_guides_fatal_tables_and_an_unlisted_one_its_own_word() {
        // 12001 egress crossbar overflow ("Fatal" table), 12020 egress sequence ID error
        // ("Always Fatal"), 12028 ("Non-Fatal" table) even when a line calls it fatal, 99999
        // unlisted.
        assert!(fatal_sxid(Some(12001), false) && fatal_sxid(Some(12020), false));
        assert!(!fatal_sxid(Some(12028), true));
        assert!(fatal_sxid(Some(99999), true) && !fatal_sxid(Some(99999), false));
        assert!(fatal_sxid(None, true));
    }

    #[test]
    fn prune_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["xid79-100.tar.gz", "sxid12001-300.tar.gz", "xid48-200.tar.gz", "xid79-400.tar.gz", "other.txt"] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        prune(dir.path(), 2);
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["other.txt", "sxid12001-300.tar.gz", "xid79-400.tar.gz"]);
    }
}
