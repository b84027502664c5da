//! The probe desk: every probe run the service starts goes through it — at boot, when idle,
//! and on the platform's request (`POST /v1/probes`) — so there is one run at a time and one
//! answer to "is one running?".
//!
//! Rules:
//! 1. One run at a time. A request while a run is queued or running is refused with that run
//!    (the HTTP side answers 409 and names it); the probe lock (`probe::child`) stays the last
//!    word across processes (D-Bus `RunProbes`, a person's `phq-agent probe`).
//! 2. A request runs only when every GPU is idle in the last published snapshot (no compute
//!    process, no utilisation, per NVML; unknown counts as busy): a re-check must never take
//!    GPU time from a tenant's job. Refused otherwise, naming each GPU and why.
//! 3. At most `probes.max_requests` accepted requests per `probes.request_window` (a platform
//!    with a retry loop gone wrong must not keep the GPUs busy); past it, refused with when the
//!    oldest request leaves the window. 0 turns requests off. Boot and idle runs do not count.
//! 4. Every run has an id, given when it is accepted; its record (queued, running, done,
//!    failed, with times and counts) stays readable for the last `KEPT_RUNS` runs, and the run
//!    whose results a report carries is named in it (`probe_run`), so a platform can tell its
//!    re-check's result from an older one.

use crate::config::ProbeLevel;
pub use crate::report::probe_run::{AskedBy, Channel, ProbeRun, Source, State};
use crate::snapshot::{Snapshot, Timestamp};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Finished runs kept for `GET /v1/probes/{id}`: enough for a platform that polls minutes
/// later, after a boot and an idle run came in between.
pub const KEPT_RUNS: usize = 16;

/// What the probe task is asked to run.
pub struct Ask {
    pub snapshot: Arc<Snapshot>,
    pub level: ProbeLevel,
    pub id: String,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// Rule 1: this run is queued or running.
    Running(Box<ProbeRun>),
    /// Rule 2: each GPU that is not idle, and why.
    Busy(Vec<String>),
    /// Rule 3: the window is full until this much time has passed.
    Limited(Duration),
    /// Rule 3: `probes.max_requests = 0`.
    Off,
    /// The probe task has stopped (the service is stopping).
    Stopping,
}

/// `probes.max_requests` per `probes.request_window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub max: u32,
    pub window: Duration,
}

impl From<&crate::config::ProbesConfig> for Limit {
    fn from(c: &crate::config::ProbesConfig) -> Limit {
        Limit { max: c.max_requests, window: c.request_window }
    }
}

pub struct Desk {
    book: Mutex<Book>,
    asks: mpsc::UnboundedSender<Ask>,
}

struct Book {
    limit: Limit,
    /// The run queued or running now.
    current: Option<ProbeRun>,
    /// When each accepted request within the window came (rule 3), oldest first.
    requests: VecDeque<Instant>,
    finished: VecDeque<ProbeRun>,
}

impl Desk {
    /// The desk, and where the probe task receives what it is asked to run.
    pub fn new(limit: Limit) -> (Arc<Desk>, mpsc::UnboundedReceiver<Ask>) {
        let (asks, rx) = mpsc::unbounded_channel();
        let book = Book { limit, current: None, requests: VecDeque::new(), finished: VecDeque::new() };
        (Arc::new(Desk { book: Mutex::new(book), asks }), rx)
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        // A panic while holding the book leaves it consistent: every change is one assignment.
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new configuration's limit (SIGHUP); requests already counted stay counted.
    pub fn set_limit(&self, limit: Limit) {
        self.book().limit = limit;
    }

    /// A request (rules 1–3) from `who`: the run accepted, queued for the probe task. Rule 3's
    /// limit counts the network's requests (the platform's, the tenant's control token); root
    /// over D-Bus is not limited, as a person's `phq-agent probe` is not.
    pub fn request(&self, level: ProbeLevel, snapshot: Arc<Snapshot>, who: AskedBy) -> Result<ProbeRun, Refused> {
        let now = Instant::now();
        let mut book = self.book();
        if let Some(run) = &book.current {
            return Err(Refused::Running(Box::new(run.clone())));
        }
        let busy = busy_gpus(&snapshot);
        if !busy.is_empty() {
            return Err(Refused::Busy(busy));
        }
        if who == AskedBy::LocalRoot {
            return self.queue(&mut book, level, Source::Request, who, snapshot);
        }
        let limit = book.limit;
        if limit.max == 0 {
            return Err(Refused::Off);
        }
        while book.requests.front().is_some_and(|t| now.duration_since(*t) >= limit.window) {
            book.requests.pop_front();
        }
        if book.requests.len() >= limit.max as usize {
            let oldest = book.requests.front().copied().unwrap_or(now);
            return Err(Refused::Limited(limit.window.saturating_sub(now.duration_since(oldest))));
        }
        let run = self.queue(&mut book, level, Source::Request, who, snapshot)?;
        book.requests.push_back(now);
        Ok(run)
    }

    /// The service's own run at boot or when idle (rule 1 only: the caller has checked that the
    /// GPUs are idle, and these do not count against the platform's limit). `None`: one runs.
    pub fn begin(&self, level: ProbeLevel, source: Source, snapshot: Arc<Snapshot>) -> Option<ProbeRun> {
        let mut book = self.book();
        if book.current.is_some() {
            return None;
        }
        self.queue(&mut book, level, source, AskedBy::Service, snapshot).ok()
    }

    fn queue(
        &self,
        book: &mut Book,
        level: ProbeLevel,
        source: Source,
        asked_by: AskedBy,
        snapshot: Arc<Snapshot>,
    ) -> Result<ProbeRun, Refused> {
        let run = ProbeRun {
            id: new_id(),
            level,
            source,
            asked_by,
            state: State::Queued,
            requested_at: Timestamp::now(),
            started_at: None,
            finished_at: None,
            findings: None,
            failed: None,
            error: None,
        };
        self.asks.send(Ask { snapshot, level, id: run.id.clone() }).map_err(|_| Refused::Stopping)?;
        book.current = Some(run.clone());
        Ok(run)
    }

    /// The probe task started run `id`.
    pub fn started(&self, id: &str) {
        if let Some(run) = self.book().current.as_mut().filter(|r| r.id == id) {
            run.state = State::Running;
            run.started_at = Some(Timestamp::now());
        }
    }

    /// Run `id` ended: with its findings, or with why it could not run. The record, as kept.
    pub fn finished(&self, id: &str, outcome: Result<&[crate::checks::Finding], &str>) -> Option<ProbeRun> {
        let mut book = self.book();
        let mut run = book.current.take_if(|r| r.id == id)?;
        run.finished_at = Some(Timestamp::now());
        match outcome {
            Ok(findings) => {
                run.state = State::Done;
                run.findings = Some(findings.len());
                run.failed = Some(findings.iter().filter(|f| f.severity == crate::checks::Severity::Fail).count());
            }
            Err(why) => {
                run.state = State::Failed;
                run.error = Some(why.to_string());
            }
        }
        if book.finished.len() == KEPT_RUNS {
            book.finished.pop_front();
        }
        book.finished.push_back(run.clone());
        Some(run)
    }

    /// Run `id`'s record, if it is current or among the last `KEPT_RUNS`.
    pub fn run(&self, id: &str) -> Option<ProbeRun> {
        let book = self.book();
        book.current.iter().chain(book.finished.iter().rev()).find(|r| r.id == id).cloned()
    }
}

/// Rule 2: each GPU that is not idle in `s`, and why; empty when all are idle. No NVML, or no
/// GPU at all, is not idle either: nothing says the probes would find a GPU to themselves.
pub fn busy_gpus(s: &Snapshot) -> Vec<String> {
    let Some(n) = s.nvml() else {
        return vec!["NVML did not answer in the last snapshot: whether the GPUs are idle is unknown".into()];
    };
    if n.devices.is_empty() {
        return vec!["NVML lists no GPU".into()];
    }
    let mut busy = vec![];
    for g in &n.devices {
        let processes = match g.processes.value() {
            Some(p) if p.is_empty() => None,
            Some(p) => Some(format!("{} compute process(es)", p.len())),
            None => Some("its compute processes are unknown".into()),
        };
        let utilization = match g.utilization.value() {
            Some(u) if u.gpu == 0 => None,
            Some(u) => Some(format!("{} % utilisation", u.gpu)),
            None => Some("its utilisation is unknown".into()),
        };
        let why: Vec<String> = processes.into_iter().chain(utilization).collect();
        if !why.is_empty() {
            let name = g.pci_address.value().cloned().unwrap_or_else(|| format!("GPU {}", g.index));
            busy.push(format!("{name}: {}", why.join(", ")));
        }
    }
    busy
}

/// 64 random bits in hex: unique across restarts without a counter on disk.
fn new_id() -> String {
    let mut b = [0u8; 8];
    // getrandom(2) with no flags blocks only before the pool is first seeded (early boot); its
    // failure is left as a time-derived id, still unique enough for a record kept in memory.
    // SAFETY: `b` is a valid buffer of `b.len()` bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b = (t.as_nanos() as u64).to_be_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests;
