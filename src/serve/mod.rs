//! serve: the systemd service, as a few tasks with one owner each (`service.rs` has the table of
//! who owns and tells what). The rules, and the code that keeps each:
//!
//! 1. A snapshot (collect → check → report) is taken at start, then every `SNAPSHOT_INTERVAL`,
//!    and at once when NVML reports an Xid. Collecting is blocking I/O: it runs on the blocking
//!    pool, one at a time; a request never triggers one. — `service::snapshotter` (and the first
//!    one in `service::run`), `take_snapshot`.
//! 2. Each snapshot is published whole (report JSON and both metrics renderings, plain and
//!    gzipped, together) by swapping one `Arc`; readers see the previous one until the swap,
//!    never a mix. Every body is made once, when the snapshot is taken: a request, and the push
//!    of the periodic status, only hand out the same bytes (`Bytes`), never render or compress.
//!    A part a client asks for alone (`?findings=not-passed`, `?name[]=`) is cut from those
//!    bodies at most once per snapshot for what was last asked. — `service::publish`,
//!    `Published`, `http::answer`, `metrics::renders`, `subset`.
//! 3. `READY=1` goes to systemd after the first publish, with a `STATUS=` line a person can read
//!    in `systemctl status`; watchdog pings follow at half `WatchdogSec` while the service's
//!    loops turn. The first snapshot's NVML part ends by `nvml.init_timeout` whatever NVML does,
//!    so READY=1 comes by then; while an NVML call is past its deadline, `STATUS=` and /healthz
//!    say "NVML has not answered for N s (call)". — `service::run`, `service::watchdog`,
//!    `nvml_not_answering`.
//! 4. SIGTERM/SIGINT: `STOPPING=1`, stop accepting, exit 0; the loops stop first, so the last
//!    events reach the spool, then HTTP and the pusher. SIGHUP: reload config and token; an
//!    invalid new config is logged and the old one kept. — `service::run`, `Signals::until_stopped`,
//!    `service::reload`.
//! 5. `seq` grows by one per snapshot and is persisted in `state_dir/seq` (atomic rename), so it
//!    keeps growing across restarts; a lost or corrupt `seq` file resumes after the highest seq
//!    in the spool, loudly, never from 0. The file holds the end of a block of `SEQ_BLOCK`
//!    numbers reserved ahead, written before the first of them is used, so a snapshot at rest
//!    writes nothing; a clean stop writes the last number used, and after a crash the numbering
//!    resumes past the block (a gap, never a number twice). — `Seq`, shared by the snapshotter
//!    and the event task.
//! 6. Xids are events, merged so that a storm cannot flood the spool or the loop: the first of
//!    a code on a GPU is spooled at once and triggers a snapshot; its repeats within
//!    `XID_WINDOW` are counted and spooled as one event with that `count` when the window
//!    closes (or the service stops). journald does the same with "Suppressed N messages".
//!    — `service::events`, `XidWindow`.
//! 7. Spool writes run on their own thread (`SpoolWriter`), never on a loop; the watchdog is
//!    pinged by its own task for as long as the snapshotter and the event task keep turning
//!    (`LOOP_STALL`), so a burst of events cannot starve it and a hung task still stops it. The
//!    snapshotter counts as turning while its snapshot runs within the snapshot's bound (every
//!    NVML phase to its deadline, plus `LOOP_STALL`), never because a worker reports in.
//!    — `SpoolWriter`, `service::watchdog`, `service::Snapshotter::snapshot_bound`.
//! 8. At start, Xids in this boot's kernel log after `KMSG_XID_MARK` (the last kernel log
//!    record a running agent has seen) become events, merged per GPU and code: an Xid that NVML
//!    delivered while the agent was being killed, before it reached the spool, or one that came
//!    while the agent was down, is not lost. (One that did reach the spool may be sent twice: at
//!    least once, as every event.) — `service::events`, `unseen_kernel_xids`.
//! 9. SXids, which only the kernel log reports, are read as the NVSwitch driver writes them: a
//!    follower reads the kernel log from the service's start (before the first snapshot, so
//!    nothing falls between it and rule 8), and each SXid is merged per NVSwitch and code like an
//!    Xid (rule 6), the first of a kind spooled at once and judged at once. Rule 8 covers the
//!    SXids of this boot that no running agent saw. — `collect::kmsg::Follower`,
//!    `service::events`, `XidWindow`, `unseen_kernel_xids`.

pub mod agent_checks;
pub mod bug_bundle;
pub mod client_ca;
pub mod client_name;
pub mod dbus;
pub mod h2c;
pub mod http;
pub mod kubevirt_ca;
pub mod memory;
pub mod metrics;
pub mod own_cert;
pub mod port;
pub mod push;
pub mod recheck;
pub mod service;
pub mod subset;
pub mod tls;
pub mod vsock;
pub mod vsock_stream;

pub use service::{run, Machine};

use crate::checks::{self, Settings};
use crate::collect::NvmlSource;
use crate::config::Config;
use crate::report::{self, Health};
use crate::snapshot::Timestamp;
use crate::sysroot::Sysroot;
use bytes::Bytes;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub const SNAPSHOT_INTERVAL: Duration = Duration::from_secs(30);
/// Repeats of one Xid code on one GPU within this window become one event (rule 6). Our own
/// choice, shorter than journald's 30 s rate-limit interval (journald.conf(5),
/// `RateLimitIntervalSec=`) so that the counted repeats reach the platform within seconds.
pub const XID_WINDOW: Duration = Duration::from_secs(10);
/// The watchdog stops being pinged when the loop has not turned for this long (rule 7): two
/// snapshot intervals, so a snapshot hung on a wedged driver gets the service restarted.
pub const LOOP_STALL: Duration = Duration::from_secs(60);
/// How often an idle loop turns just to say it is alive (rule 7): a quarter of `LOOP_STALL`, so
/// a loop that turns is never taken for a stalled one, and at rest the service wakes for it four
/// times a minute rather than every second.
pub const HEARTBEAT: Duration = Duration::from_secs(15);

/// What rule 6 merges repeats of: one Xid code on one GPU, or one SXid code (with the driver's
/// word for it) on one NVSwitch.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Seen {
    Xid { gpu: String, xid: u64 },
    Sxid { nvswitch: String, sxid: u64, fatal: bool },
}

impl Seen {
    /// The event this stands for, `count` times in its window.
    fn event(&self, count: u64) -> report::Event {
        match self {
            Seen::Xid { gpu, xid } => xid_event(gpu, *xid, count),
            Seen::Sxid { nvswitch, sxid, fatal } => report::Event::Sxid {
                nvswitch: nvswitch.clone(),
                sxid: *sxid,
                fatal: *fatal,
                source: "kernel-log".into(),
                count,
            },
        }
    }
}

/// Rules 6 and 9: windows per Xid code and GPU, and per SXid code and NVSwitch.
#[derive(Debug, Default)]
pub struct XidWindow {
    open: std::collections::HashMap<Seen, (std::time::Instant, u64)>,
}

impl XidWindow {
    /// An Xid or SXid seen now. `Some`: the first of its kind in a window, to spool at once.
    /// `None`: a repeat, counted for the window's closing event.
    pub fn note(&mut self, seen: Seen, now: std::time::Instant) -> Option<report::Event> {
        match self.open.get_mut(&seen) {
            Some((_, repeats)) => {
                *repeats += 1;
                None
            }
            None => {
                let first = seen.event(1);
                self.open.insert(seen, (now, 0));
                Some(first)
            }
        }
    }

    /// The windows older than `XID_WINDOW` at `now`, closed: one event per window that had
    /// repeats, with their count.
    pub fn due(&mut self, now: std::time::Instant) -> Vec<report::Event> {
        self.close(|opened| now.duration_since(opened) >= XID_WINDOW)
    }

    /// When the oldest open window closes: the event task sleeps until then, not on a beat.
    pub fn next_close(&self) -> Option<std::time::Instant> {
        self.open.values().map(|(opened, _)| *opened + XID_WINDOW).min()
    }

    /// Every window, closed (the service is stopping): no counted repeat is left behind.
    pub fn close_all(&mut self) -> Vec<report::Event> {
        self.close(|_| true)
    }

    fn close(&mut self, expired: impl Fn(std::time::Instant) -> bool) -> Vec<report::Event> {
        let mut keys: Vec<Seen> = self.open.iter().filter(|(_, (t, _))| expired(*t)).map(|(k, _)| k.clone()).collect();
        keys.sort();
        keys.into_iter()
            .filter_map(|k| {
                let (_, repeats) = self.open.remove(&k)?;
                (repeats > 0).then(|| k.event(repeats))
            })
            .collect()
    }
}

fn xid_event(gpu: &str, xid: u64, count: u64) -> report::Event {
    report::Event::Xid { gpu: gpu.to_string(), xid, source: "nvml".into(), count }
}

/// Rule 8: `state_dir/kmsg-xid-mark` holds `<boot id> <kmsg seq>` of the newest kernel log
/// record a running agent has seen.
pub const KMSG_XID_MARK: &str = "kmsg-xid-mark";

/// The kernel log's Xids and SXids that no running agent saw (after the mark, or all of this
/// boot's when the mark is of another boot or missing), as events merged per device and code.
pub fn unseen_kernel_xids(state_dir: &Path, s: &crate::snapshot::Snapshot) -> Vec<report::Event> {
    let Some(log) = s.kernel_log.value() else { return vec![] };
    let mark = std::fs::read_to_string(state_dir.join(KMSG_XID_MARK)).unwrap_or_default();
    let after = match (mark.split_once(' '), s.host.boot_id.as_deref()) {
        (Some((boot, seq)), Some(now)) if boot == now => seq.trim().parse::<u64>().ok(),
        _ => None,
    };
    let unseen = |seq: Option<u64>| seq.is_some_and(|seq| after.is_none_or(|a| seq > a));
    let mut counts: std::collections::BTreeMap<(String, u64), u64> = Default::default();
    for x in &log.xids {
        if let (true, Some(code)) = (unseen(x.seq), x.xid) {
            *counts.entry((format!("{}.0", x.pci.to_ascii_lowercase()), u64::from(code))).or_default() += 1;
        }
    }
    let mut sxids: std::collections::BTreeMap<(String, u64, bool), u64> = Default::default();
    for x in &log.sxids {
        if let (true, Some(code)) = (unseen(x.seq), x.sxid) {
            *sxids.entry((x.pci.clone(), u64::from(code), x.fatal)).or_default() += 1;
        }
    }
    counts
        .into_iter()
        .map(|((gpu, xid), count)| report::Event::Xid { gpu, xid, source: "kernel-log".into(), count })
        .chain(sxids.into_iter().map(|((nvswitch, sxid, fatal), count)| report::Event::Sxid {
            nvswitch,
            sxid,
            fatal,
            source: "kernel-log".into(),
            count,
        }))
        .collect()
}

/// Notes the newest kernel log record of `s` as seen (rule 8); written only when it moved.
pub fn mark_kernel_log_seen(state_dir: &Path, s: &crate::snapshot::Snapshot, last: &mut Option<u64>) {
    let (Some(log), Some(boot)) = (s.kernel_log.value(), s.host.boot_id.as_deref()) else { return };
    let Some(newest) = log.xids.iter().filter_map(|x| x.seq).chain(log.sxids.iter().filter_map(|x| x.seq)).max() else {
        return;
    };
    if *last == Some(newest) {
        return;
    }
    match crate::durable::write(&state_dir.join(KMSG_XID_MARK), format!("{boot} {newest}\n").as_bytes(), 0o644) {
        Ok(()) => *last = Some(newest),
        Err(e) => {
            tracing::warn!(error = %e, "cannot note the kernel log as seen; its Xids may be sent again after a restart")
        }
    }
}

/// What became of events (rule 6 and push rule 9), shared by the loop, the spool writer and
/// the snapshots that report it.
#[derive(Debug, Default)]
pub struct EventCounters {
    pub merged: std::sync::atomic::AtomicU64,
    pub dropped: std::sync::atomic::AtomicU64,
}

/// Rule 7: spool writes on a thread of their own, in the order they were handed over.
pub struct SpoolWriter {
    tx: Option<std::sync::mpsc::Sender<(u64, Vec<u8>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SpoolWriter {
    pub fn start(
        spool: push::Spool,
        wake: Arc<tokio::sync::Notify>,
        counters: Arc<EventCounters>,
    ) -> std::io::Result<SpoolWriter> {
        let (tx, rx) = std::sync::mpsc::channel::<(u64, Vec<u8>)>();
        let thread = std::thread::Builder::new().name("spool-writer".into()).spawn(move || {
            use std::sync::atomic::Ordering;
            let mut full_since: Option<u64> = None;
            for (seq, body) in rx {
                match spool.put(seq, &body) {
                    Ok(push::Put::Stored) => {
                        if full_since.take().is_some() {
                            tracing::warn!(seq, "the spool has room again");
                        }
                        wake.notify_one();
                    }
                    Ok(push::Put::Full) => {
                        counters.dropped.fetch_add(1, Ordering::Relaxed);
                        if full_since.is_none() {
                            full_since = Some(seq);
                            tracing::error!(
                                seq,
                                bytes = spool.bytes(),
                                bound = push::MAX_SPOOL_BYTES,
                                "the spool is full: events are counted as dropped until the platform takes some"
                            );
                        }
                    }
                    Err(e) => {
                        counters.dropped.fetch_add(1, Ordering::Relaxed);
                        // A full disk must not lose the event silently: say what and where.
                        tracing::error!(seq, error = %e, "cannot write an event to the spool");
                    }
                }
            }
        })?;
        Ok(SpoolWriter { tx: Some(tx), thread: Some(thread) })
    }

    pub fn send(&self, seq: u64, body: Vec<u8>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send((seq, body));
        }
    }

    /// Waits until every event handed over is written (at stop).
    pub fn finish(mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the endpoints answer from: one snapshot, rendered once.
#[derive(Debug, Clone)]
pub struct Published {
    pub health: Health,
    pub report_json: Bytes,
    /// `/metrics` in both formats, plain and gzipped (`Metrics`).
    pub metrics: Metrics,
    /// The parts of both a client may ask for alone (`subset`).
    pub subsets: subset::Subsets,
    /// The read token for `/v1/status` and `/metrics`; `None` refuses them.
    pub token: Option<String>,
    /// The control token, which may also start work (`POST /v1/probes`); `None`: no token does.
    pub control_token: Option<String>,
    pub summary: String,
    /// Why the service is not healthy, when it can say it without credentials (NVML not
    /// answering): /healthz adds it to "unhealthy".
    pub reason: Option<String>,
    /// The snapshot itself, for the probes run on request.
    pub snapshot: Arc<crate::snapshot::Snapshot>,
}

/// One snapshot's `/metrics` bodies, each made at most once and only when first asked for: both
/// renderings at the first scrape, each format's gzip at the first scrape that asks for it
/// (`Accept-Encoding: gzip`, as Prometheus sends), then kept for the snapshot's life — never per
/// scrape, and never at all when no one scrapes: at rest the service renders nothing (a
/// rendering of 8 GPUs with the dcgm-exporter names was an eighth of an idle snapshot's CPU and
/// two 160 KB strings held for its life). What it costs instead: the snapshot's report, kept.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// What the renderings are made of: the snapshot, its report, and `metrics.dcgm_compat`.
    from: Option<(Arc<crate::snapshot::Snapshot>, Arc<report::Report>, bool)>,
    /// (text format, OpenMetrics).
    rendered: std::sync::OnceLock<(Bytes, Bytes)>,
    text_gzip: std::sync::OnceLock<Bytes>,
    openmetrics_gzip: std::sync::OnceLock<Bytes>,
}

impl Metrics {
    pub fn of(snapshot: Arc<crate::snapshot::Snapshot>, report: Arc<report::Report>, dcgm_compat: bool) -> Metrics {
        Metrics { from: Some((snapshot, report, dcgm_compat)), ..Default::default() }
    }

    /// Bodies given whole (tests, and stand-ins).
    pub fn fixed(text: &str, openmetrics: &str) -> Metrics {
        let m = Metrics::default();
        let _ = m.rendered.set((Bytes::from(text.to_string()), Bytes::from(openmetrics.to_string())));
        m
    }

    /// The body a scrape asked for, made now if it was not yet.
    pub fn body(&self, openmetrics: bool, gzip: bool) -> Bytes {
        let (text, om) = self.rendered.get_or_init(|| match &self.from {
            Some((snapshot, report, dcgm)) => {
                let m = metrics::render(snapshot, report, *dcgm);
                (Bytes::from(m.text), Bytes::from(m.openmetrics))
            }
            None => Default::default(),
        });
        match (openmetrics, gzip) {
            (false, false) => text.clone(),
            (true, false) => om.clone(),
            (false, true) => self.text_gzip.get_or_init(|| Bytes::from(metrics::gzip(text))).clone(),
            (true, true) => self.openmetrics_gzip.get_or_init(|| Bytes::from(metrics::gzip(om))).clone(),
        }
    }
}

pub type Shared = Arc<RwLock<Option<Arc<Published>>>>;

/// The published snapshot, if there is one yet.
pub fn current(shared: &Shared) -> Option<Arc<Published>> {
    match shared.read() {
        Ok(g) => g.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// A bearer token is a line of text; anything longer is a mistake, or an attack.
pub const MAX_TOKEN_BYTES: u64 = 4096;

/// Reads the bearer token. A file that group or others can read is refused: the token is the
/// only thing between the cluster network and the report.
pub fn read_token(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    // A regular file of a few bytes, not a FIFO (a hang) or a device (endless bytes); a
    // symlink is followed, since an operator may point the token at a secret mounted elsewhere.
    let (file, meta) =
        crate::sysroot::open_regular(path, false).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        anyhow::bail!(
            "{}: mode {mode:04o} lets other users read the token; refusing it (chmod 600 {})",
            path.display(),
            path.display()
        );
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_TOKEN_BYTES + 1), &mut bytes)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_TOKEN_BYTES {
        anyhow::bail!("{}: larger than {MAX_TOKEN_BYTES} bytes; not a token", path.display());
    }
    let token = String::from_utf8(bytes)
        .map_err(|_| anyhow::anyhow!("{}: the token is not text", path.display()))?
        .trim()
        .to_string();
    if token.len() < 16 {
        anyhow::bail!("{}: the token is shorter than 16 characters", path.display());
    }
    Ok(token)
}

/// Numbers reserved ahead in `state_dir/seq` (rule 5): one durable write (a file and a
/// directory fsync) per 64 snapshots or events, about half an hour at rest, instead of one each.
/// Our choice; the schema promises a `seq` that grows across restarts, not one without gaps.
const SEQ_BLOCK: u64 = 64;

/// The `seq` persisted in `state_dir`.
pub struct Seq {
    path: PathBuf,
    next: u64,
    /// The last number the file reserves (rule 5); `next` beyond it reserves the next block.
    reserved: u64,
}

impl Seq {
    /// Resumes after the higher of `state_dir/seq` and the spool's highest seq. A `seq` file
    /// that is there but unreadable or not a number is said loudly, never taken for 0: the
    /// spool (and the epoch in every Idempotency-Key) keeps new numbers from meeting old ones.
    pub fn load(state_dir: &Path) -> Seq {
        let path = state_dir.join("seq");
        let in_file = match std::fs::read_to_string(&path) {
            Ok(text) => match text.trim().parse::<u64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    tracing::error!(path = %path.display(), content = %text.escape_debug().to_string().chars().take(40).collect::<String>(), "seq file is corrupt; resuming after the highest seq in the spool");
                    None
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "seq file is unreadable; resuming after the highest seq in the spool");
                None
            }
        };
        let spooled = push::Spool::highest_seq(state_dir);
        if spooled > in_file {
            tracing::warn!(path = %path.display(), seq_file = ?in_file, spool = ?spooled, "the spool is ahead of the seq file; resuming after the spool");
        }
        let last = in_file.max(spooled).unwrap_or(0);
        Seq { path, next: last + 1, reserved: last }
    }

    /// The next number; its block is written down before it is used, so a crash never hands
    /// the same number out twice.
    pub fn take(&mut self) -> u64 {
        let n = self.next;
        self.next += 1;
        if n > self.reserved {
            let end = n + SEQ_BLOCK - 1;
            match crate::durable::write(&self.path, end.to_string().as_bytes(), 0o666) {
                Ok(()) => self.reserved = end,
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot persist seq; it restarts from 1 after a restart")
                }
            }
        }
        n
    }
}

impl Drop for Seq {
    /// A clean stop gives back the unused rest of the block: the next start continues at once.
    /// Only while the file still holds this `Seq`'s own reservation, so a second `Seq` of the
    /// same directory (a test's simulated crash) is never written over with a lower number.
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.path).ok().and_then(|t| t.trim().parse::<u64>().ok());
        if self.next > 1 && ours == Some(self.reserved) && self.next - 1 < self.reserved {
            let _ = crate::durable::write(&self.path, (self.next - 1).to_string().as_bytes(), 0o666);
        }
    }
}

/// Asks the vsock listener's CA bundle for its status (`client_ca::ReloadingCa::status`).
pub type VsockCaStatus = Arc<dyn Fn() -> report::VsockCa + Send + Sync>;

/// Everything one snapshot needs, cloned into the blocking task.
#[derive(Clone)]
pub struct Inputs {
    pub sysroot: PathBuf,
    /// Where NVML comes from: for the service, one session kept across snapshots.
    pub nvml: NvmlSource,
    pub config: Config,
    pub token: Option<String>,
    pub control_token: Option<String>,
    pub started_at: Timestamp,
    /// The last probe run's results and findings, carried into every report until the next.
    pub probes: Option<Arc<ProbeResults>>,
    /// What the push loop last saw, for agent.platform-reachable.
    pub push: Arc<std::sync::Mutex<agent_checks::PushState>>,
    /// Event accounting and the spool, for `agent.events` in every report.
    pub events: Arc<EventCounters>,
    pub spool: Option<push::Spool>,
    /// All of NVML's phases within this (the first snapshot, which systemd waits for: READY=1
    /// comes by the init deadline at the latest); `None`, each phase its own deadline.
    pub nvml_budget: Option<Duration>,
    /// The fault history across boots (`crate::history`), kept in the state directory; `None`
    /// where there is none to keep (tests of the snapshot alone).
    pub history: Option<Arc<std::sync::Mutex<crate::history::History>>>,
    /// What KubeVirt's CA bundle behind the vsock listener is now (`client_ca`'s status), for
    /// `agent.vsock_ca` in every report.
    pub vsock_ca: Option<VsockCaStatus>,
}

/// One probe run's results, as the service carries them into its reports.
#[derive(Debug, Clone)]
pub struct ProbeResults {
    pub probes: serde_json::Value,
    pub findings: Vec<checks::Finding>,
    /// The run, as `recheck::Desk` recorded it; its id is the one the history's clearing names.
    pub run: recheck::ProbeRun,
}

/// The fault history of `state_dir`, for the service. One that cannot be read is moved aside
/// (`history.json.unreadable`), said loudly, and a new one started: the service keeps running
/// and the old bytes are kept for a person.
pub fn open_history(state_dir: &std::path::Path) -> crate::history::History {
    match crate::history::History::load(state_dir) {
        Ok(h) => h,
        Err(e) => {
            let path = crate::history::History::path(state_dir);
            let aside = path.with_extension("json.unreadable");
            let moved = std::fs::rename(&path, &aside);
            tracing::error!(error = %e, kept_as = %aside.display(), moved = moved.is_ok(), "the fault history cannot be read; starting a new one");
            crate::history::History::default()
        }
    }
}

/// Rules 2–4 of `crate::history` on one report: the faults recorded for this boot, a new probe
/// run's passes clearing what they cover, repeats across boots escalated, and the verdict
/// taken again with what the history knows.
fn apply_history(inputs: &Inputs, snapshot: &crate::snapshot::Snapshot, report: &mut report::Report) {
    let Some(history) = &inputs.history else { return };
    let mut h = history.lock().unwrap_or_else(|p| p.into_inner());
    let boot = snapshot.host.boot_id.clone().unwrap_or_else(|| "unknown".into());
    let mut changed = h.record(snapshot, &report.findings, &boot, snapshot.observed_at);
    if let Some(p) = &inputs.probes {
        // The run proves what it saw from its start: a fault last seen after that stays open.
        let from = p.run.started_at.unwrap_or(p.run.requested_at);
        changed |= h.clear_by_probes(snapshot, &p.run.id, &p.run.asked_by, from, &p.findings);
    }
    h.escalate(snapshot, &mut report.findings);
    report.verdict = report::verdict_for(snapshot, &report.findings, snapshot.observed_at);
    if let Some(t) = h.since(snapshot, &report.findings, report.verdict.action) {
        report.verdict.since = Some(t);
    }
    if changed {
        if let Err(e) = h.save(&inputs.config.agent.state_dir) {
            tracing::error!(error = %e, "the fault history is not saved; it is kept in memory and written at the next change");
        }
    }
}

/// Collects, checks and renders one snapshot; the report comes back too, for the events.
pub fn take_snapshot(inputs: &Inputs, seq: u64) -> (Published, Arc<report::Report>) {
    // One snapshot's reading: the path lookups cached for its life (`Sysroot::cached`).
    let root = Sysroot::new(&inputs.sysroot).cached();
    let snapshot = crate::collect::snapshot_within(&root, &inputs.nvml, inputs.nvml_budget);
    let mut findings = checks::run(&snapshot, &Settings::from(&inputs.config));
    if let Some(p) = &inputs.probes {
        findings.extend(p.findings.iter().cloned());
    }
    let push = inputs.push.lock().map(|g| g.clone()).unwrap_or_else(|p| p.into_inner().clone());
    findings.push(agent_checks::platform_reachable(&inputs.config, &push));
    findings.push(agent_checks::endpoint_auth(&inputs.config, inputs.token.is_some()));
    let mut report = report::build(
        &snapshot,
        findings,
        report::agent_id(&inputs.config.agent.id, &snapshot),
        inputs.started_at,
        seq,
    );
    report.probes = inputs.probes.as_ref().map(|p| p.probes.clone());
    report.probe_run = inputs.probes.as_ref().map(|p| p.run.clone());
    apply_history(inputs, &snapshot, &mut report);
    report.agent.events = Some(report::EventCounts {
        merged: inputs.events.merged.load(std::sync::atomic::Ordering::Relaxed),
        dropped: inputs.events.dropped.load(std::sync::atomic::Ordering::Relaxed),
        spooled: inputs.spool.as_ref().map_or(0, |s| s.len() as u64),
        spool_bytes: inputs.spool.as_ref().map_or(0, |s| s.bytes()),
    });
    report.agent.vsock_ca = inputs.vsock_ca.as_ref().map(|status| status());
    report.install = crate::install::report_value();
    let count = |sev| report.findings.iter().filter(|f| f.severity == sev).count();
    let not_answering = nvml_not_answering(&snapshot);
    let summary = format!(
        "{}{} GPU(s), {}: {} failed, {} warning(s); snapshot {}",
        not_answering.as_deref().map(|n| format!("{n}; ")).unwrap_or_default(),
        report.gpus.len(),
        format!("{:?}", report.health).to_lowercase(),
        count(checks::Severity::Fail),
        count(checks::Severity::Warn),
        report.observed_at
    );
    let (snapshot, report) = (Arc::new(snapshot), Arc::new(report));
    let published = Published {
        health: report.health,
        report_json: Bytes::from(serde_json::to_vec(&*report).unwrap_or_default()),
        metrics: Metrics::of(snapshot.clone(), report.clone(), inputs.config.metrics.dcgm_compat),
        subsets: subset::Subsets::of(report.clone()),
        token: inputs.token.clone(),
        control_token: inputs.control_token.clone(),
        summary,
        reason: not_answering,
        snapshot,
    };
    (published, report)
}

/// `NVML has not answered for 42 s (nvmlInit_v2)`, the longest-blocked call, when any is: for
/// systemd's STATUS= line and /healthz, so a person sees why before reading the report.
pub fn nvml_not_answering(s: &crate::snapshot::Snapshot) -> Option<String> {
    let b = s.nvml_blocked.iter().max_by_key(|b| b.blocked_ms)?;
    let gpu = b.gpu.as_deref().map(|g| format!(" on GPU {g}")).unwrap_or_default();
    Some(format!("NVML has not answered for {} s ({}{gpu})", crate::snapshot::whole_seconds(b.blocked_ms), b.call))
}

/// Whether every GPU is idle: no compute process and no utilisation, per NVML
/// (`recheck::busy_gpus`). Unknown counts as busy: a probe must never take GPU time from a
/// tenant's job.
pub fn all_gpus_idle(s: &crate::snapshot::Snapshot) -> bool {
    recheck::busy_gpus(s).is_empty()
}

/// Runs the probes at `level` on this machine, in a child process under a deadline
/// (`probe::child`); the error says why they could not run at all (logged here too).
pub fn run_probes(
    snapshot: &crate::snapshot::Snapshot,
    level: crate::config::ProbeLevel,
    state_dir: &std::path::Path,
    limits: crate::probe::child::Limits,
    who: &str,
) -> Result<(serde_json::Value, Vec<checks::Finding>), String> {
    crate::probe::child::run(snapshot, level, state_dir, who, limits, &mut |step| tracing::info!("probe: {step}"))
        .map(|a| (a.probes, a.findings))
        .inspect_err(|e| tracing::warn!(error = %e, "probes cannot run"))
}

/// The installer ended (done, failed, reboot required) in a state no event has gone out for:
/// the event, and the key to mark it sent with. `sent` is that key of the last one
/// (`state_dir/install-event-sent`), so neither a restart nor the reboot between the install's
/// end and the agent's next snapshot loses the event, and none goes out twice.
pub fn install_event(sent: Option<&str>, after: &report::Report) -> Option<(report::Event, String)> {
    let v = after.install.as_ref()?;
    let status = v["status"].as_str().unwrap_or_default().to_string();
    let key = format!("{status} {}", v["updated_at"].as_str().unwrap_or_default());
    if sent.map(str::trim) == Some(key.as_str()) || !matches!(status.as_str(), "done" | "failed" | "reboot-required") {
        return None;
    }
    let error = v["error"].as_str().map(String::from);
    Some((report::Event::Install { status, error }, key))
}

pub const INSTALL_EVENT_SENT: &str = "install-event-sent";

/// Findings whose severity changed from `before` to `after`, as events.
pub fn severity_changes(before: &report::Report, after: &report::Report) -> Vec<report::Event> {
    let key = |f: &checks::Finding| (f.id.clone(), f.gpu.clone());
    let old: std::collections::HashMap<_, _> = before.findings.iter().map(|f| (key(f), f.severity)).collect();
    after
        .findings
        .iter()
        .filter_map(|f| {
            let was = old.get(&key(f)).copied()?;
            (was != f.severity).then(|| report::Event::SeverityChange {
                check: f.id.clone(),
                gpu: f.gpu.clone(),
                from: was,
                to: f.severity,
                summary: f.summary.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::testutil::healthy;

    fn report_of(s: &crate::snapshot::Snapshot) -> report::Report {
        report::build(s, checks::run(s, &Settings::default()), "vm".into(), s.observed_at, 1)
    }

    #[test]
    fn xid_repeats_in_a_window_become_one_counted_event() {
        let t0 = std::time::Instant::now();
        let mut w = XidWindow::default();
        let xid = |gpu: &str, xid: u64| Seen::Xid { gpu: gpu.into(), xid };
        let first = w.note(xid("0000:0c:00.0", 13), t0).expect("the first goes at once");
        assert!(matches!(first, report::Event::Xid { count: 1, .. }));
        for i in 0..999 {
            assert!(w.note(xid("0000:0c:00.0", 13), t0 + Duration::from_millis(i)).is_none());
        }
        assert!(w.note(xid("0000:0c:00.0", 31), t0).is_some(), "another code has its own window");
        assert!(w.note(xid("0000:0d:00.0", 13), t0).is_some(), "another GPU has its own window");
        // SXids have windows of their own, per NVSwitch and code (rule 9).
        let sxid = Seen::Sxid { nvswitch: "0000:11:00.0".into(), sxid: 20034, fatal: true };
        assert!(matches!(w.note(sxid.clone(), t0), Some(report::Event::Sxid { count: 1, .. })));
        assert!(w.note(sxid.clone(), t0).is_none());
        assert!(w.note(sxid, t0).is_none());
        assert!(w.due(t0 + XID_WINDOW - Duration::from_millis(1)).is_empty(), "not before the window closes");
        let closed = w.due(t0 + XID_WINDOW);
        assert_eq!(
            closed,
            vec![
                xid_event("0000:0c:00.0", 13, 999),
                report::Event::Sxid {
                    nvswitch: "0000:11:00.0".into(),
                    sxid: 20034,
                    fatal: true,
                    source: "kernel-log".into(),
                    count: 2
                }
            ],
            "only windows with repeats make an event"
        );
        // The next one opens a new window and goes at once again.
        assert!(w.note(xid("0000:0c:00.0", 13), t0 + XID_WINDOW).is_some());
        w.note(xid("0000:0c:00.0", 13), t0 + XID_WINDOW);
        assert_eq!(w.close_all(), vec![xid_event("0000:0c:00.0", 13, 1)], "stopping leaves nothing counted behind");
    }

    #[test]
    fn an_event_report_carries_only_what_the_event_is_about() {
        let mut s = healthy();
        if let crate::snapshot::NvmlStatus::Ok(n) = &mut s.nvml {
            n.xid_events = vec![crate::snapshot::NvmlXid { gpu: "0000:0c:00.0".into(), xid: 79 }];
        }
        let full = report_of(&s);
        assert!(full.findings.iter().any(|f| f.severity == checks::Severity::Fail), "the Xid fails the GPU");
        let gpu = full.gpus[3].pci_address.clone();
        let e = report::event_report(&full, xid_event(&gpu, 79, 1));
        assert_eq!(e.gpus.len(), 1);
        assert_eq!(e.gpus[0].pci_address, gpu);
        assert!(e
            .findings
            .iter()
            .all(|f| f.gpu.as_deref() == Some(gpu.as_str()) && f.severity != checks::Severity::Pass));
        assert_eq!((e.agent.clone(), e.health, e.seq), (full.agent.clone(), full.health, full.seq));
        let (small, whole) = (serde_json::to_vec(&e).unwrap().len(), serde_json::to_vec(&full).unwrap().len());
        assert!(small * 4 < whole, "an event report of {small} bytes beside a full one of {whole}");
    }

    #[test]
    fn an_sxid_event_report_carries_its_switch_and_the_gpus_its_fatal_sxid_took_down() {
        let mut s = healthy();
        s.kernel_log = crate::snapshot::Fact::Value(crate::collect::kmsg::parse(
            "3,1,1,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n",
            "/dev/kmsg",
        ));
        let full = report_of(&s);
        let event = report::Event::Sxid {
            nvswitch: "0000:11:00.0".into(),
            sxid: 20034,
            fatal: true,
            source: "kernel-log".into(),
            count: 1,
        };
        let e = report::event_report(&full, event);
        assert!(e.findings.iter().all(|f| f.id == "fabric.sxid" && f.severity == checks::Severity::Fail));
        assert_eq!(e.findings.len(), 9, "the NVSwitch and the 8 GPUs behind it");
        assert_eq!(e.gpus.len(), 8);
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../schema/phq.status.v1.json")).expect("schema is JSON");
        let v = serde_json::to_value(&e).unwrap();
        assert!(jsonschema::is_valid(&schema, &v), "{v:#}");
    }

    #[test]
    fn kernel_log_xids_no_running_agent_saw_become_events_once() {
        use crate::snapshot::{Fact, KernelLog, XidEvent};
        let dir = tempfile::tempdir().unwrap();
        let mut s = healthy();
        s.host.boot_id = Some("boot-a".into());
        let xid = |seq: u64, code: u32| XidEvent {
            pci: "0000:0C:00".into(),
            xid: Some(code),
            raw_code: code.to_string(),
            usec: Some(seq * 1000),
            seq: Some(seq),
            message: String::new(),
        };
        s.kernel_log =
            Fact::Value(KernelLog { xids: vec![xid(10, 79), xid(11, 79), xid(12, 13)], ..Default::default() });
        let event = |xid: u64, count: u64| report::Event::Xid {
            gpu: "0000:0c:00.0".into(),
            xid,
            source: "kernel-log".into(),
            count,
        };
        // No mark yet: every Xid of this boot, merged per code.
        assert_eq!(unseen_kernel_xids(dir.path(), &s), vec![event(13, 1), event(79, 2)]);
        let mut last = None;
        mark_kernel_log_seen(dir.path(), &s, &mut last);
        assert!(unseen_kernel_xids(dir.path(), &s).is_empty(), "seen by a running agent");
        // Killed before it spooled the next one: the restart finds it.
        if let Fact::Value(log) = &mut s.kernel_log {
            log.xids.push(xid(13, 48));
        }
        assert_eq!(unseen_kernel_xids(dir.path(), &s), vec![event(48, 1)]);
        // SXids too (rule 9), and the mark moves past them.
        if let Fact::Value(log) = &mut s.kernel_log {
            log.sxids = crate::collect::kmsg::parse(
                "3,14,14000,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n",
                "/dev/kmsg",
            )
            .sxids;
        }
        let sxid = report::Event::Sxid {
            nvswitch: "0000:11:00.0".into(),
            sxid: 20034,
            fatal: true,
            source: "kernel-log".into(),
            count: 1,
        };
        assert_eq!(unseen_kernel_xids(dir.path(), &s), vec![event(48, 1), sxid]);
        mark_kernel_log_seen(dir.path(), &s, &mut last);
        assert!(unseen_kernel_xids(dir.path(), &s).is_empty(), "the mark is the newest record, an SXid's");
        // Another boot: the mark is of the last one, so this boot's log is all new.
        s.host.boot_id = Some("boot-b".into());
        assert_eq!(unseen_kernel_xids(dir.path(), &s).len(), 4);
    }

    #[test]
    fn a_corrupt_or_lost_seq_file_resumes_after_the_spool_not_at_zero() {
        let dir = tempfile::tempdir().unwrap();
        let spool = push::Spool::open(dir.path(), "e1").unwrap();
        spool.put(41, b"{}").unwrap();
        spool.put(42, b"{}").unwrap();
        std::fs::write(dir.path().join("seq"), "\0\0garbage").unwrap();
        assert_eq!(Seq::load(dir.path()).take(), 43, "corrupt: after the spool");
        std::fs::remove_file(dir.path().join("seq")).unwrap();
        assert_eq!(Seq::load(dir.path()).take(), 43, "lost: after the spool");
        // A refused event still counts: its number was handed out.
        std::fs::rename(
            dir.path().join("spool/00000000000000000042-e1.json"),
            dir.path().join("spool/refused/00000000000000000042-e1.json"),
        )
        .unwrap();
        std::fs::remove_file(dir.path().join("spool/00000000000000000041-e1.json")).unwrap();
        std::fs::write(dir.path().join("seq"), "7").unwrap();
        assert_eq!(Seq::load(dir.path()).take(), 43, "behind the spool (a restored VM): after the spool");
        std::fs::write(dir.path().join("seq"), "100\n").unwrap();
        let mut seq = Seq::load(dir.path());
        assert_eq!((seq.take(), seq.take()), (101, 102));
        // A crash now (`seq` never dropped): the next start resumes past the reserved block.
        let after_crash = Seq::load(dir.path()).take();
        assert_eq!(after_crash, 101 + SEQ_BLOCK, "each number's block is written down before it is used");
        drop(seq);
        assert!(Seq::load(dir.path()).take() > after_crash, "an older Seq's stop never moves the file back");
    }

    /// Rule 5: a block of numbers costs one durable write; a clean stop hands back the rest.
    #[test]
    fn seq_writes_once_per_block_and_a_clean_stop_continues_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seq");
        let mut s = Seq::load(dir.path());
        assert_eq!(s.take(), 1);
        let written = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::fs::write(&path, SEQ_BLOCK.to_string()).unwrap();
        let marked = std::fs::metadata(&path).unwrap().modified().unwrap();
        for want in 2..=SEQ_BLOCK {
            assert_eq!(s.take(), want);
        }
        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), marked, "no write inside the block");
        assert!(marked >= written);
        assert_eq!(s.take(), SEQ_BLOCK + 1);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), (2 * SEQ_BLOCK).to_string(), "the next block");
        drop(s);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), (SEQ_BLOCK + 1).to_string());
        assert_eq!(Seq::load(dir.path()).take(), SEQ_BLOCK + 2);
    }

    #[test]
    fn the_installer_ending_is_an_event_once() {
        let mut after = report_of(&healthy());
        assert_eq!(install_event(None, &after), None, "no install ran");
        after.install = Some(serde_json::json!({"status": "running", "updated_at": "t2", "error": null}));
        assert_eq!(install_event(None, &after), None);
        after.install = Some(
            serde_json::json!({"schema": "phq.install/v1", "status": "failed", "updated_at": "t3", "error": "step toolkit: E"}),
        );
        let (event, key) = install_event(Some("reboot-required t1"), &after).unwrap();
        assert_eq!(event, report::Event::Install { status: "failed".into(), error: Some("step toolkit: E".into()) });
        assert_eq!(install_event(Some(&format!("{key}\n")), &after), None, "sent once");
        after.event = Some(event);
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../schema/phq.status.v1.json")).expect("schema is JSON");
        let v = serde_json::to_value(&after).unwrap();
        assert!(jsonschema::is_valid(&schema, &v), "{v:#}");
    }

    #[test]
    fn a_severity_change_is_an_event_and_nothing_else_is() {
        let before = healthy();
        let mut after = healthy();
        if let crate::snapshot::NvmlStatus::Ok(n) = &mut after.nvml {
            n.devices[2].ecc_volatile =
                crate::snapshot::Nv::Value(crate::snapshot::EccCounts { corrected: 0, uncorrected: 1 });
        }
        let events = severity_changes(&report_of(&before), &report_of(&after));
        assert_eq!(events.len(), 1, "{events:?}");
        match &events[0] {
            report::Event::SeverityChange { check, gpu, from, to, .. } => {
                assert_eq!(check, "gpu.ecc-uncorrectable");
                assert_eq!(gpu.as_deref(), Some("0000:0b:00.0"));
                assert_eq!((*from, *to), (checks::Severity::Pass, checks::Severity::Fail));
            }
            other => panic!("{other:?}"),
        }
        assert!(severity_changes(&report_of(&before), &report_of(&before)).is_empty());
    }

    #[test]
    fn seq_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Seq::load(dir.path());
        assert_eq!((s.take(), s.take()), (1, 2));
        drop(s);
        let mut s = Seq::load(dir.path());
        assert_eq!(s.take(), 3);
    }

    #[test]
    fn token_files_others_can_read_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t");
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(read_token(&p).unwrap_err().to_string().contains("mode 0640"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_token(&p).unwrap(), "0123456789abcdef0123");
        std::fs::write(&p, "short\n").unwrap();
        assert!(read_token(&p).unwrap_err().to_string().contains("shorter than 16"));
    }
}
