//! The NVML session: one handle kept across snapshots, and every call made through it on a
//! worker under a deadline (`collect::deadline`), so a driver that blocks costs a deadline and
//! one thread, never the snapshot. What the calls read is `super`'s business.

use super::super::deadline::{self, Answered, Late, Outcome, Tracker};
use super::{
    classify_init_error, drain_xid_events, normalize_bus_id, nv, nvlink_p2p, read_device, remapped_rows,
    throttle_names, unreadable, unreadable_device,
};
use crate::snapshot::{
    BlockedCall, Nv, NvmlFailure, NvmlFailureKind, NvmlGpu, NvmlInfo, NvmlStatus, NvmlXid, Timestamp,
};
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::NvmlLib;
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One reading through a session of its own (doctor, probe, install: one snapshot each).
pub fn read(library: &str, deadlines: Deadlines) -> Reading {
    Session::new(library, deadlines).read(None)
}

/// One board's power and enforced limit, mW (`Session::powers`), or why NVML could not say.
pub type PowerReading = Result<(u32, Option<u32>), String>;

/// What one reading of NVML gave: its status, and the calls that did not answer in time.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub status: NvmlStatus,
    pub blocked: Vec<BlockedCall>,
}

/// How long each phase of a reading may take before its call is abandoned
/// (`collect::deadline`): NVML blocks rather than fails on a GPU that has fallen off the bus or
/// a GSP that stopped answering (Xid 79, 119).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// `nvmlInit_v2`, which attaches every GPU.
    pub init: Duration,
    /// Everything read about one GPU (about sixty calls), the system-wide calls, and the GPM
    /// samples of all GPUs together.
    pub gpu: Duration,
    /// Registering every GPU for Xid events and draining what is pending; also the NVLink
    /// peer matrix.
    pub events: Duration,
}

impl Default for Deadlines {
    /// Many times what a healthy 8-GPU guest needs: `nvmlInit_v2` takes seconds there without
    /// persistence mode (NVIDIA's driver persistence documentation: each initialisation sets the
    /// GPUs up again), and one GPU's readings take milliseconds.
    fn default() -> Self {
        Deadlines { init: Duration::from_secs(30), gpu: Duration::from_secs(10), events: Duration::from_secs(10) }
    }
}

impl Deadlines {
    /// The longest a reading of `gpus` GPUs can take when every phase runs to its deadline.
    pub fn worst_case(&self, gpus: u32) -> Duration {
        // The system-wide calls, each GPU, and GPM for all GPUs together under `gpu`; the peer
        // matrix and the Xid events under `events`.
        self.init + self.gpu * (gpus + 2) + self.events * 2
    }
}

/// What a call past its deadline was about (rule 3 of `collect::deadline`: one at a time each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    /// Device count and versions: NVML as a whole.
    System,
    Gpu(u32),
    P2p,
    /// The GPM samples and metrics of every GPU together.
    Gpm,
    Events,
    Conditions,
    Power,
}

/// An NVML session kept across snapshots. `nvmlInit` attaches every GPU — seconds on an 8-GPU
/// guest, more without persistence mode (NVIDIA's driver persistence documentation: with no
/// client holding the GPUs, each initialisation sets them up again) — so the service opens one
/// and keeps it, and opens a new one only after a reading says the old one is gone (the driver
/// was unloaded or upgraded underneath it).
///
/// Every call runs on a worker under a deadline (`collect::deadline`); a call past it is
/// remembered, and the thing it was about (NVML, one GPU) is not asked again until it returns:
/// later readings say "still blocked since …" instead of leaving one more thread behind.
pub struct Session {
    library: String,
    deadlines: Deadlines,
    state: std::sync::Mutex<State>,
    answered: std::sync::Mutex<Option<Answered>>,
    /// The Xid watcher's account, shared with its thread (`Watched`).
    watched: Arc<std::sync::Mutex<Watched>>,
}

/// What the Xid watcher has seen. While its thread waits, a snapshot reports these instead of
/// opening an event set of its own: on the real driver, `nvmlEventSetCreate` does not return
/// while another thread of the process is in `nvmlEventSetWait` (seen on an H200 with driver
/// 580.159.04, docs/hardware-validation.md: the service's second snapshot then passed its events
/// deadline and judged NVML unresponsive). A set registered later would not have the earlier
/// Xids anyway: registration "starts recording" (nvml.h, `nvmlDeviceRegisterEvents`).
#[derive(Debug, Default)]
pub(super) struct Watched {
    /// The watcher's thread is waiting (set before it starts, cleared when it ends).
    pub(super) active: bool,
    /// The Xids it received since the service started, the newest `WATCHED_KEPT`.
    pub(super) seen: std::collections::VecDeque<NvmlXid>,
}

/// How many watched Xids a snapshot carries: our choice, the per-snapshot cap of a drain.
pub(super) const WATCHED_KEPT: usize = super::MAX_EVENTS_PER_SNAPSHOT;

impl Watched {
    pub(super) fn note(&mut self, x: NvmlXid) {
        if self.seen.len() == WATCHED_KEPT {
            self.seen.pop_front();
        }
        self.seen.push_back(x);
    }
}

#[derive(Default)]
struct State {
    held: Option<Arc<Held>>,
    /// An `nvmlInit_v2` past its deadline; its handle is taken when it returns.
    init: Option<Late<Result<Held, NvmlFailure>>>,
    late: BTreeMap<Target, Late<()>>,
    /// Each GPU's PCI address from the last reading that had it, to name a GPU that blocks.
    addresses: BTreeMap<u32, String>,
}

pub(super) struct Held {
    // Field order: `sys` (symbols only) is dropped before `nvml`, whose drop shuts NVML down.
    sys: Option<NvmlLib>,
    pub(super) nvml: Nvml,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("library", &self.library).finish_non_exhaustive()
    }
}

/// A late call's entry in a reading.
fn blocked_of<T>(late: &Late<T>, gpu: Option<String>) -> BlockedCall {
    let gpu = late.tracker.address().or(gpu);
    BlockedCall {
        call: late.tracker.current().to_string(),
        gpu,
        since: Timestamp(late.since_wall),
        blocked_ms: late.blocked_for().as_millis() as u64,
        deadline_ms: late.deadline.as_millis() as u64,
    }
}

/// `Late<T>` → `Late<()>`, for the map of late calls whose answers are not wanted.
fn forget<T>(late: Late<T>) -> Late<()> {
    late.forget()
}

impl Session {
    pub fn new(library: &str, deadlines: Deadlines) -> Session {
        Session {
            library: library.to_string(),
            deadlines,
            state: std::sync::Mutex::new(State::default()),
            answered: std::sync::Mutex::new(None),
            watched: Arc::default(),
        }
    }

    pub fn library(&self) -> &str {
        &self.library
    }

    pub fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    /// Runs `hook` (on a worker thread) each time a call that passed its deadline returns: the
    /// service takes a snapshot at once rather than at its next tick.
    pub fn on_answer(&self, hook: Answered) {
        *self.answered.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// The live handle, if NVML has answered (the Xid watcher shares it; it never initialises).
    pub(super) fn handle(&self) -> Option<Arc<Held>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).held.clone()
    }

    /// The Xid watcher's account (`Watched`), for the watcher to share with its thread.
    pub(super) fn watched(&self) -> Arc<std::sync::Mutex<Watched>> {
        self.watched.clone()
    }

    fn hook(&self) -> Option<Answered> {
        self.answered.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The live handle, initialising NVML first (under the init deadline) if there is none.
    fn held(&self, st: &mut State, until: Option<Instant>) -> Result<Arc<Held>, (NvmlFailure, Vec<BlockedCall>)> {
        if let Some(h) = &st.held {
            return Ok(h.clone());
        }
        if let Some(late) = &st.init {
            match late.poll() {
                None => {
                    let b = blocked_of(late, None);
                    return Err((self.not_answering(&b), vec![b]));
                }
                Some(answer) => {
                    st.init = None;
                    let held = answer.map_err(|()| self.failure("nvmlInit_v2: the worker thread panicked"));
                    let held = held.and_then(|r| r).map_err(|f| (f, vec![]))?;
                    tracing::info!(library = %self.library, "nvmlInit_v2 answered after its deadline; NVML is read again");
                    let h = Arc::new(held);
                    st.held = Some(h.clone());
                    return Ok(h);
                }
            }
        }
        let library = self.library.clone();
        let deadline = bounded(self.deadlines.init, until);
        match deadline::call(deadline, Tracker::new("nvmlInit_v2"), self.hook(), move |_| init(&library)) {
            Outcome::Done(Ok(held)) => {
                let h = Arc::new(held);
                st.held = Some(h.clone());
                Ok(h)
            }
            Outcome::Done(Err(f)) => Err((f, vec![])),
            Outcome::NotStarted(why) => Err((self.failure(&why), vec![])),
            Outcome::Late(late) => {
                let b = blocked_of(&late, None);
                tracing::error!(library = %self.library, deadline = ?late.deadline, "nvmlInit_v2 has not returned within its deadline");
                st.init = Some(late);
                Err((self.not_answering(&b), vec![b]))
            }
        }
    }

    fn failure(&self, message: &str) -> NvmlFailure {
        NvmlFailure { kind: NvmlFailureKind::Other, library: self.library.clone(), message: message.to_string() }
    }

    fn not_answering(&self, b: &BlockedCall) -> NvmlFailure {
        NvmlFailure {
            kind: NvmlFailureKind::NotAnswering,
            library: self.library.clone(),
            message: format!("{} (deadline {} s)", b.describe(), crate::snapshot::whole_seconds(b.deadline_ms)),
        }
    }

    /// What GPU `address` runs at right now: clocks, temperature, power and the clocks-event
    /// (throttle) reasons, read beside a probe's figure so a throttled GPU is told apart from a
    /// slow link. Each reading NVML cannot give is left out.
    pub fn conditions(&self, address: &str) -> Result<crate::snapshot::Conditions, String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let h = self.held(&mut st, None).map_err(|(f, _)| f.message)?;
        if let Some(late) = st.late.get(&Target::Conditions) {
            if !late.finished() {
                return Err(blocked_of(late, None).describe());
            }
        }
        let address = address.to_string();
        let out = deadline::call(self.deadlines.gpu, Tracker::new("nvmlDeviceGetCount_v2"), self.hook(), move |t| {
            conditions(&h, &address, t)
        });
        match out {
            Outcome::Done(r) => r,
            Outcome::NotStarted(why) => Err(why),
            Outcome::Late(late) => {
                let why = blocked_of(&late, None).describe();
                st.late.insert(Target::Conditions, forget(late));
                Err(why)
            }
        }
    }

    /// Each GPU's board power now (`nvmlDeviceGetPowerUsage`) and the limit it enforces
    /// (`nvmlDeviceGetEnforcedPowerLimit`), both in mW, for GPUs `addresses` in one call under
    /// the per-GPU deadline: the power test samples all its boards ten times a second.
    pub fn powers(&self, addresses: &[String]) -> Result<Vec<PowerReading>, String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let h = self.held(&mut st, None).map_err(|(f, _)| f.message)?;
        if let Some(late) = st.late.get(&Target::Power) {
            if !late.finished() {
                return Err(blocked_of(late, None).describe());
            }
        }
        let addresses = addresses.to_vec();
        let out = deadline::call(self.deadlines.gpu, Tracker::new("nvmlDeviceGetCount_v2"), self.hook(), move |t| {
            powers(&h, &addresses, t)
        });
        match out {
            Outcome::Done(r) => r,
            Outcome::NotStarted(why) => Err(why),
            Outcome::Late(late) => {
                let why = blocked_of(&late, None).describe();
                st.late.insert(Target::Power, forget(late));
                Err(why)
            }
        }
    }

    /// Reads every GPU, initialising NVML first if this session has no live handle; each phase
    /// under its deadline, and all of them within `budget` when one is given (the service's
    /// first snapshot, which systemd waits for).
    pub fn read(&self, budget: Option<Duration>) -> Reading {
        let until = budget.map(|b| Instant::now() + b);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let h = match self.held(&mut st, until) {
            Ok(h) => h,
            Err((f, blocked)) => return Reading { status: NvmlStatus::Failed(f), blocked },
        };
        st.late.retain(|_, l| !l.finished());
        let reading = self.read_from(&mut st, &h, until);
        if session_gone(&reading.status) {
            tracing::info!(library = %self.library, "NVML session lost; a new one is opened at the next snapshot");
            st.held = None;
        }
        reading
    }

    /// One reading through the live handle `h`, phase by phase: NVML as a whole, each GPU, then
    /// over the GPUs that answered the NVLink peer matrix, GPM and the pending Xid events. A
    /// phase still blocked from an earlier reading is not asked again (rule 3 of
    /// `collect::deadline`); past `until` the phases left are not started.
    fn read_from(&self, st: &mut State, h: &Arc<Held>, until: Option<Instant>) -> Reading {
        let (count, driver_version, nvml_version, cuda_driver_version) = match self.read_system(st, h, until) {
            Ok(system) => system,
            Err((f, blocked)) => return Reading { status: NvmlStatus::Failed(f), blocked },
        };
        let mut found = self.read_devices(st, h, until, count);
        // The NVLink peer matrix, over the GPUs that answered.
        self.across(
            st,
            h,
            &mut found,
            Across {
                target: Target::P2p,
                deadline: self.deadlines.events,
                first_call: "nvmlDeviceGetP2PStatus",
                read: nvlink_p2p,
                put: |g, v| g.nvlink_p2p = v,
            },
        );
        // GPM over the GPUs that answered: two samples, one pause for all (`super::gpm`).
        self.across(
            st,
            h,
            &mut found,
            Across {
                target: Target::Gpm,
                deadline: self.deadlines.gpu,
                first_call: "nvmlGpmQueryDeviceSupport",
                read: super::gpm,
                put: |g, v| g.gpm = v,
            },
        );
        let (xid_events, events_error) = self.read_xid_events(st, h, &mut found);
        Reading {
            status: NvmlStatus::Ok(NvmlInfo {
                library: self.library.clone(),
                driver_version,
                nvml_version,
                cuda_driver_version,
                devices: found.devices,
                xid_events,
                events_error,
            }),
            blocked: found.blocked,
        }
    }

    /// NVML as a whole: the device count and the versions; `Err` why not, with the call found
    /// blocked.
    fn read_system(
        &self,
        st: &mut State,
        h: &Arc<Held>,
        until: Option<Instant>,
    ) -> Result<System, (NvmlFailure, Vec<BlockedCall>)> {
        if let Some(late) = st.late.get(&Target::System) {
            let b = blocked_of(late, None);
            return Err((self.not_answering(&b), vec![b]));
        }
        let hh = h.clone();
        let system = deadline::call(
            bounded(self.deadlines.gpu, until),
            Tracker::new("nvmlDeviceGetCount_v2"),
            self.hook(),
            move |t| {
                t.at("nvmlDeviceGetCount_v2");
                let count = hh.nvml.device_count();
                t.at("nvmlSystemGetDriverVersion");
                let driver = nv(hh.nvml.sys_driver_version());
                t.at("nvmlSystemGetNVMLVersion");
                let nvml = nv(hh.nvml.sys_nvml_version());
                t.at("nvmlSystemGetCudaDriverVersion_v2");
                let cuda = nv(hh.nvml.sys_cuda_driver_version());
                (count, driver, nvml, cuda)
            },
        );
        let (count, driver_version, nvml_version, cuda_driver_version) = match system {
            Outcome::Done(v) => v,
            Outcome::NotStarted(why) => return Err((self.failure(&why), vec![])),
            Outcome::Late(late) => {
                let b = blocked_of(&late, None);
                st.late.insert(Target::System, forget(late));
                return Err((self.not_answering(&b), vec![b]));
            }
        };
        match count {
            Ok(c) => Ok((c, driver_version, nvml_version, cuda_driver_version)),
            Err(e) => {
                let message = format!("nvmlDeviceGetCount: {e}");
                Err((NvmlFailure { kind: NvmlFailureKind::Other, library: self.library.clone(), message }, vec![]))
            }
        }
    }

    /// Each GPU on a worker of its own; one that blocks is not asked again until it answers.
    fn read_devices(&self, st: &mut State, h: &Arc<Held>, until: Option<Instant>, count: u32) -> Found {
        let mut found =
            Found { devices: Vec::with_capacity(count as usize), answering: vec![], blocked: vec![], until };
        for i in 0..count {
            let known = st.addresses.get(&i).cloned();
            if let Some(late) = st.late.get(&Target::Gpu(i)) {
                let b = blocked_of(late, known.clone());
                found.devices.push(unreadable(i, format!("{} (still blocked)", b.describe()), b.gpu.clone()));
                found.blocked.push(b);
                continue;
            }
            if found.out_of_time() {
                let why = "not read: the first snapshot's time for NVML ran out".to_string();
                found.devices.push(unreadable(i, why, known));
                continue;
            }
            let hh = h.clone();
            let tracker = Tracker::new("nvmlDeviceGetHandleByIndex_v2");
            match deadline::call(bounded(self.deadlines.gpu, until), tracker, self.hook(), move |t| {
                match hh.nvml.device_by_index(i) {
                    Ok(d) => read_device(i, &d, hh.sys.as_ref(), t),
                    Err(e) => unreadable_device(i, &e),
                }
            }) {
                Outcome::Done(g) => {
                    if let Nv::Value(a) = &g.pci_address {
                        st.addresses.insert(i, a.clone());
                        found.answering.push((i, a.clone()));
                    }
                    found.devices.push(g);
                }
                Outcome::NotStarted(why) => found.devices.push(unreadable(i, why, known)),
                Outcome::Late(late) => {
                    let b = blocked_of(&late, known);
                    tracing::error!(gpu = ?b.gpu, call = %b.call, "an NVML call has not returned within its deadline");
                    found.devices.push(unreadable(i, b.describe(), b.gpu.clone()));
                    found.blocked.push(b);
                    st.late.insert(Target::Gpu(i), forget(late));
                }
            }
        }
        found
    }

    /// A phase over every GPU that answered, under one deadline: each GPU's answer goes where
    /// `phase.put` puts it; while the phase is still blocked from an earlier reading, or when it
    /// runs late or cannot start, its reason goes there on every GPU instead.
    fn across<T: Send + 'static>(&self, st: &mut State, h: &Arc<Held>, found: &mut Found, phase: Across<T>) {
        let put = phase.put;
        if let Some(b) = st.late.get(&phase.target).map(|l| blocked_of(l, None)) {
            for g in &mut found.devices {
                put(g, Nv::Error(format!("{} (still blocked)", b.describe())));
            }
            found.blocked.push(b);
            return;
        }
        if found.answering.is_empty() || found.out_of_time() {
            return;
        }
        let (hh, asked, read) = (h.clone(), found.answering.clone(), phase.read);
        match deadline::call(
            bounded(phase.deadline, found.until),
            Tracker::new(phase.first_call),
            self.hook(),
            move |t| read(&hh.nvml, &asked, t),
        ) {
            Outcome::Done(answers) => {
                for (i, v) in answers {
                    if let Some(g) = found.devices.iter_mut().find(|g| g.index == i) {
                        put(g, v);
                    }
                }
            }
            Outcome::NotStarted(why) => found.devices.iter_mut().for_each(|g| put(g, Nv::Error(why.clone()))),
            Outcome::Late(late) => {
                let b = blocked_of(&late, None);
                found.devices.iter_mut().for_each(|g| put(g, Nv::Error(b.describe())));
                found.blocked.push(b);
                st.late.insert(phase.target, forget(late));
            }
        }
    }

    /// Xid events pending, from the GPUs that answered; why there are none, when none could be
    /// read.
    fn read_xid_events(&self, st: &mut State, h: &Arc<Held>, found: &mut Found) -> (Vec<NvmlXid>, Option<String>) {
        {
            let w = self.watched.lock().unwrap_or_else(|p| p.into_inner());
            if w.active {
                return (w.seen.iter().cloned().collect(), None);
            }
        }
        if let Some(b) = st.late.get(&Target::Events).map(|l| blocked_of(l, None)) {
            let why = format!("{} (still blocked)", b.describe());
            found.blocked.push(b);
            return (Vec::new(), Some(why));
        }
        if found.out_of_time() {
            return (Vec::new(), Some("not read: the first snapshot's time for NVML ran out".into()));
        }
        let (hh, asked) = (h.clone(), found.answering.iter().map(|(i, _)| *i).collect::<Vec<_>>());
        match deadline::call(
            bounded(self.deadlines.events, found.until),
            Tracker::new("nvmlEventSetCreate"),
            self.hook(),
            move |t| drain_xid_events(&hh.nvml, &asked, t),
        ) {
            Outcome::Done(v) => v,
            Outcome::NotStarted(why) => (Vec::new(), Some(why)),
            Outcome::Late(late) => {
                let b = blocked_of(&late, None);
                let why = b.describe();
                found.blocked.push(b);
                st.late.insert(Target::Events, forget(late));
                (Vec::new(), Some(why))
            }
        }
    }
}

/// NVML as a whole: the device count, the driver's, NVML's and CUDA's versions.
type System = (u32, Nv<String>, Nv<String>, Nv<i32>);

/// The GPUs of one reading so far: what each gave, the ones that answered (index and address),
/// the calls found blocked, and when the first snapshot's time for NVML runs out.
struct Found {
    devices: Vec<NvmlGpu>,
    answering: Vec<(u32, String)>,
    blocked: Vec<BlockedCall>,
    until: Option<Instant>,
}

impl Found {
    fn out_of_time(&self) -> bool {
        self.until.is_some_and(|u| Instant::now() >= u)
    }
}

/// What a phase over every GPU asks NVML: each GPU's answer, by index.
type ReadAcross<T> = fn(&Nvml, &[(u32, String)], &Tracker) -> Vec<(u32, Nv<T>)>;

/// A phase read over every GPU that answered (`Session::across`): the NVLink peer matrix, GPM.
struct Across<T> {
    /// What a call past its deadline was about.
    target: Target,
    deadline: Duration,
    /// The call its tracker names until the phase says otherwise.
    first_call: &'static str,
    read: ReadAcross<T>,
    put: fn(&mut NvmlGpu, Nv<T>),
}

/// `phase`, shortened to what is left before `until`.
fn bounded(phase: Duration, until: Option<Instant>) -> Duration {
    match until {
        Some(u) => phase.min(u.saturating_duration_since(Instant::now())).max(Duration::from_millis(1)),
        None => phase,
    }
}

/// `nvmlInit_v2` and the second handle for the calls nvml-wrapper does not wrap.
fn init(library: &str) -> Result<Held, NvmlFailure> {
    let nvml = Nvml::builder().lib_path(OsStr::new(library)).init().map_err(|e| classify_init_error(library, &e))?;
    // SAFETY: loading the library a second time returns the same handle (dlopen reference
    // counts it); NvmlLib only resolves symbols. NVML is initialised by `nvml` and stays so
    // while `sys` is used, since both live in `Held`, which drops `sys` first.
    let sys = unsafe { NvmlLib::new(library) }.ok();
    Ok(Held { sys, nvml })
}

/// The board power and enforced limit of each GPU at `addresses` (`Session::powers`).
fn powers(h: &Held, addresses: &[String], t: &Tracker) -> Result<Vec<PowerReading>, String> {
    t.at("nvmlDeviceGetCount_v2");
    let count = h.nvml.device_count().map_err(|e| format!("nvmlDeviceGetCount: {e}"))?;
    t.at("nvmlDeviceGetPciInfo_v3");
    let devices: Vec<_> = (0..count)
        .filter_map(|i| h.nvml.device_by_index(i).ok())
        .map(|d| (d.pci_info().ok().and_then(|p| normalize_bus_id(&p.bus_id)), d))
        .collect();
    Ok(addresses
        .iter()
        .map(|address| {
            let d = devices
                .iter()
                .find(|(a, _)| a.as_deref() == Some(address.as_str()))
                .map(|(_, d)| d)
                .ok_or_else(|| format!("NVML lists no GPU at {address}"))?;
            t.set_address(address);
            let mw = ask!(t, "nvmlDeviceGetPowerUsage", d.power_usage())
                .map_err(|e| format!("nvmlDeviceGetPowerUsage: {e}"))?;
            Ok((mw, ask!(t, "nvmlDeviceGetEnforcedPowerLimit", d.enforced_power_limit()).ok()))
        })
        .collect())
}

fn conditions(h: &Held, address: &str, t: &Tracker) -> Result<crate::snapshot::Conditions, String> {
    t.at("nvmlDeviceGetCount_v2");
    let count = h.nvml.device_count().map_err(|e| format!("nvmlDeviceGetCount: {e}"))?;
    t.at("nvmlDeviceGetPciInfo_v3");
    let d = (0..count)
        .filter_map(|i| h.nvml.device_by_index(i).ok())
        .find(|d| d.pci_info().ok().and_then(|p| normalize_bus_id(&p.bus_id)).as_deref() == Some(address))
        .ok_or_else(|| format!("NVML lists no GPU at {address}"))?;
    t.set_address(address);
    Ok(crate::snapshot::Conditions {
        sm_clock_mhz: ask!(t, "nvmlDeviceGetClockInfo", d.clock_info(Clock::SM)).ok(),
        mem_clock_mhz: ask!(t, "nvmlDeviceGetClockInfo", d.clock_info(Clock::Memory)).ok(),
        temperature_c: ask!(t, "nvmlDeviceGetTemperature", d.temperature(TemperatureSensor::Gpu)).ok(),
        power_mw: ask!(t, "nvmlDeviceGetPowerUsage", d.power_usage()).ok(),
        throttle_reasons: ask!(t, "nvmlDeviceGetCurrentClocksEventReasons", d.current_throttle_reasons())
            .ok()
            .map(|r| throttle_names(r.bits())),
        ecc_volatile: match (
            ask!(t, "nvmlDeviceGetTotalEccErrors", d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)),
            ask!(t, "nvmlDeviceGetTotalEccErrors", d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)),
        ) {
            (Ok(corrected), Ok(uncorrected)) => Some(crate::snapshot::EccCounts { corrected, uncorrected }),
            _ => None,
        },
        remapped_rows: h.sys.as_ref().and_then(|s| remapped_rows(s, &d, t).value().copied()),
        processes: super::compute_processes(&d, t).value().cloned(),
        utilization_gpu: ask!(t, "nvmlDeviceGetUtilizationRates", d.utilization_rates()).ok().map(|u| u.gpu),
    })
}

/// Whether a reading says the session itself is no longer good: NVML stopped answering as a
/// whole (not one GPU), as after a driver unload or an upgrade without a reboot.
fn session_gone(status: &NvmlStatus) -> bool {
    match status {
        NvmlStatus::Failed(f) => f.kind != NvmlFailureKind::NotAnswering,
        NvmlStatus::Ok(info) => matches!(info.driver_version, Nv::Error(_)),
        NvmlStatus::NotRead(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_is_shortened_to_what_is_left_of_the_budget_but_never_to_nothing() {
        let phase = Duration::from_secs(10);
        assert_eq!(bounded(phase, None), phase);
        assert_eq!(bounded(phase, Some(Instant::now())), Duration::from_millis(1), "a spent budget still asks once");
        assert!(bounded(phase, Some(Instant::now() + Duration::from_secs(3))) <= Duration::from_secs(3));
        assert_eq!(bounded(phase, Some(Instant::now() + Duration::from_secs(60))), phase);
    }

    #[test]
    fn the_worst_case_counts_every_phase_to_its_deadline() {
        let d =
            Deadlines { init: Duration::from_secs(30), gpu: Duration::from_secs(10), events: Duration::from_secs(5) };
        // init, the system calls, 8 GPUs and GPM, the NVLink matrix and the events.
        assert_eq!(d.worst_case(8), Duration::from_secs(30 + 100 + 10));
    }

    #[test]
    fn a_blocked_init_is_not_a_lost_session_but_a_failed_one_is() {
        let f = |kind| NvmlStatus::Failed(NvmlFailure { kind, library: "l".into(), message: "m".into() });
        assert!(!session_gone(&f(NvmlFailureKind::NotAnswering)), "a blocked call keeps its handle");
        assert!(session_gone(&f(NvmlFailureKind::DriverNotLoaded)));
    }
}
