//! fake-cuda: a working stand-in for `libcuda.so.1` that keeps the CUDA driver API's rules.
//!
//! It exports the driver API functions the agent calls (and those cudarc calls, so an older
//! build can be run against it too) and answers them from the JSON scenario named by
//! `PHQ_FAKE_CUDA_SCENARIO`, read at `cuInit` (docs/fake-cuda-scenario.md). Device memory lives
//! in host RAM, sparsely: only the pages something wrote hold bytes (`Mem`); time is virtual: every copy, memset or GEMM occupies its stream and the engine
//! it runs on (a GPU's host→device or device→host copy engine, its HBM, its SMs, a peer link)
//! for bytes ÷ the scenario's rate, and events read those clocks, so a probe's figures are
//! exact and checkable.
//!
//! Where a caller breaks a rule, the fake answers what the real driver answers; where the real
//! driver quietly does something slower, the fake does the same slower thing. Each rule below
//! names where the real behaviour is written down. The abbreviations: *DRV* is NVIDIA's CUDA
//! Driver API reference, *PG* the CUDA C++ Programming Guide.
//!
//! Kernels: a PTX module is parsed when it is loaded (`ptx`) and its entries executed by an
//! interpreter that checks every access as compute-sanitizer would (`interp`); launches too big
//! to interpret run through Rust models of the same kernels (`kernels`), which a differential
//! test holds equal to the PTX (`tests_ptx`). Not modelled: code generation and its caches,
//! real instruction timing, pageable host memory (every host buffer copies at the pinned rate),
//! NUMA placement of pinned memory, MIG.

pub mod blas;
pub mod codes;
mod hang;
pub mod interp;
pub mod kernels;
pub(crate) mod l2;
pub mod nccl;
pub mod power;
pub mod ptx;
pub mod scenario;

use codes::*;
use scenario::{ComputeMode, FaultOn, Scenario};
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard};

pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type Handle = *mut c_void;

/// Where each GPU's memory starts in the unified address space, and how far apart. The real
/// driver hands out addresses from one unified virtual address space (PG, "Unified Virtual
/// Address Space"), so a pointer alone says which GPU it lives on.
const BASE: u64 = 0x7f00_0000_0000;
const SPAN: u64 = 1 << 40;
/// cuMemAlloc aligns every allocation to at least 256 bytes (DRV, cuMemAlloc: "suitably
/// aligned for any kind of variable"); the fake uses 2 MiB, the large-page granularity.
const ALIGN: u64 = 2 << 20;

const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Engine {
    HostToDevice(usize),
    DeviceToHost(usize),
    Hbm(usize),
    Sm(usize),
    Link(usize, usize),
}

struct Ctx {
    device: usize,
    refs: u32,
    /// Devices whose memory this context may access directly (cuCtxEnablePeerAccess).
    peers: Vec<usize>,
    default_stream: usize,
}

struct Stream {
    ctx: usize,
    /// Virtual seconds at which the work queued so far completes.
    clock: f64,
}

struct Event {
    ctx: usize,
    timing: bool,
    at: Option<f64>,
}

/// Device memory as the fake stores it, sparse: one rule for every byte (a repeated 32-bit
/// word, or the memory-test pattern of each word's address) until something writes less than
/// all of it, then the pages written hold bytes and every other byte still follows the rule.
/// Storage only: a read sees the same bytes either way. What it costs: nothing per byte nobody
/// wrote, `PAGE` bytes (and a map entry) per page written in part or whole, so a kernel that
/// touches a few words of an 80 GB buffer costs a few pages of host RAM, and a buffer written
/// whole with one word costs none; a read of unwritten bytes computes them from the rule (a
/// doubling copy of the word, or the pattern word by word). Writing the whole allocation with
/// one word or pattern drops its pages.
///
/// What cuMemAlloc's memory holds before anything writes it is unspecified: "The memory is not
/// cleared" (DRV, cuMemAlloc). The fake's choice is the word 0 (`World::alloc`).
pub(crate) enum Mem {
    Fill(u32),
    /// Every 64-bit word holds `kernels::pattern(its address, mode, arg)`: what the memory-test
    /// kernels write over a whole allocation (address in address, random words) without the
    /// fake holding its bytes.
    Pattern {
        mode: u32,
        arg: u64,
    },
    /// Written in part: the pages written (by index, `PAGE` bytes each from the allocation's
    /// start; the last one cut at its end) hold bytes, the rest is `under`'s.
    Pages {
        under: Uniform,
        pages: BTreeMap<usize, Box<[u8]>>,
    },
}

/// The rule a sparse allocation's unwritten bytes follow (`Mem::Fill`, `Mem::Pattern`).
#[derive(Clone, Copy)]
pub(crate) enum Uniform {
    Fill(u32),
    Pattern { mode: u32, arg: u64 },
}

/// Bytes per page of written device memory: small, so that a grid-stride kernel's block, whose
/// 256 threads store 2 KiB at each of thousands of places across a buffer, materialises a
/// page per place, not more.
pub(crate) const PAGE: usize = 4096;

impl Uniform {
    /// The bytes the rule gives `dst`, `dst[0]` at offset `off` of the allocation at `base`.
    fn read_into(self, base: u64, off: usize, dst: &mut [u8]) {
        match self {
            Uniform::Fill(w) => fill_pattern(dst, w, off % 4),
            Uniform::Pattern { mode, arg } => pattern_bytes(dst, base + off as u64, mode, arg),
        }
    }
}

/// Writes the bytes of pattern memory from device address `addr` into `dst`.
pub(crate) fn pattern_bytes(dst: &mut [u8], addr: u64, mode: u32, arg: u64) {
    // A word at a time (the pattern is a function of the aligned word's address), the first and
    // last words cut to the part `dst` covers.
    let mut i = 0;
    while i < dst.len() {
        let a = addr + i as u64;
        let word = kernels::pattern(a & !7, mode, arg).to_le_bytes();
        let from = (a & 7) as usize;
        let n = (8 - from).min(dst.len() - i);
        dst[i..i + n].copy_from_slice(&word[from..from + n]);
        i += n;
    }
}

/// Writes the repeated little-endian `word` into `dst`, `dst[0]` being byte `phase` of a word.
pub(crate) fn fill_pattern(dst: &mut [u8], word: u32, phase: usize) {
    let b = word.to_le_bytes();
    let lead = (4 - phase % 4) % 4;
    let lead = lead.min(dst.len());
    for (i, x) in dst[..lead].iter_mut().enumerate() {
        *x = b[(phase + i) % 4];
    }
    // One aligned word, then doubling copies (memmove's speed): a word-at-a-time loop was a
    // quarter of a probe test's time in the fake.
    let rest = &mut dst[lead..];
    for (i, x) in rest.iter_mut().take(4).enumerate() {
        *x = b[i];
    }
    let mut filled = rest.len().min(4);
    while filled < rest.len() {
        let more = filled.min(rest.len() - filled);
        rest.copy_within(..more, filled);
        filled += more;
    }
}

/// The word whose repetition `bytes` is, if it is one (aligned at `bytes[0]`).
pub(crate) fn uniform_word(bytes: &[u8]) -> Option<u32> {
    if bytes.len() < 4 || !bytes.len().is_multiple_of(4) {
        return None;
    }
    // A repetition of its first word is the same bytes shifted by a word: one memcmp.
    let first = &bytes[..4];
    (bytes[4..] == bytes[..bytes.len() - 4]).then(|| u32::from_le_bytes([first[0], first[1], first[2], first[3]]))
}

pub(crate) struct Alloc {
    /// Its device address.
    pub(crate) base: u64,
    pub(crate) device: usize,
    ctx: usize,
    pub(crate) len: usize,
    pub(crate) mem: Mem,
    /// From the stream-ordered allocator (cuMemAllocAsync): its pool's access rules apply.
    pool: bool,
    /// Bumped on every write, so a GEMM can reuse its snapshot of an unchanged input.
    pub(crate) generation: u64,
    snapshot: Option<(u64, Arc<Vec<u8>>)>,
    /// A GEMM result not computed yet: entries are computed when something reads them.
    pending: Option<blas::Pending>,
}

impl Alloc {
    fn read_into(&self, off: usize, dst: &mut [u8]) {
        match &self.mem {
            Mem::Fill(w) => Uniform::Fill(*w).read_into(self.base, off, dst),
            Mem::Pattern { mode, arg } => Uniform::Pattern { mode: *mode, arg: *arg }.read_into(self.base, off, dst),
            Mem::Pages { under, pages } => {
                let mut at = 0;
                while at < dst.len() {
                    let (page, from) = ((off + at) / PAGE, (off + at) % PAGE);
                    let n = (PAGE - from).min(dst.len() - at);
                    match pages.get(&page) {
                        Some(bytes) => dst[at..at + n].copy_from_slice(&bytes[from..from + n]),
                        None => under.read_into(self.base, off + at, &mut dst[at..at + n]),
                    }
                    at += n;
                }
            }
        }
    }

    /// Writes `[off, off + len)` a page at a time: `fill(part, at)` gets the part of the range
    /// at byte `at` of it. A page written in part first takes its bytes from the rule.
    pub(crate) fn write_with(&mut self, off: usize, len: usize, mut fill: impl FnMut(&mut [u8], usize)) {
        let under = match self.mem {
            Mem::Fill(w) => Uniform::Fill(w),
            Mem::Pattern { mode, arg } => Uniform::Pattern { mode, arg },
            Mem::Pages { under, .. } => under,
        };
        if !matches!(self.mem, Mem::Pages { .. }) {
            self.mem = Mem::Pages { under, pages: BTreeMap::new() };
        }
        let (base, size) = (self.base, self.len);
        let Mem::Pages { pages, .. } = &mut self.mem else { return };
        let mut at = 0;
        while at < len {
            let (page, from) = ((off + at) / PAGE, (off + at) % PAGE);
            let n = (PAGE - from).min(len - at);
            let bytes = pages.entry(page).or_insert_with(|| {
                let start = page * PAGE;
                let mut b = vec![0u8; PAGE.min(size - start)].into_boxed_slice();
                if n < b.len() {
                    under.read_into(base, start, &mut b);
                }
                b
            });
            fill(&mut bytes[from..from + n], at);
            at += n;
        }
    }
}

struct Pool {
    device: usize,
    /// Other devices granted access with cuMemPoolSetAccess.
    access: Vec<usize>,
}

pub(crate) struct World {
    scenario: Scenario,
    /// CUDA ordinal → index into `scenario.devices`.
    order: Vec<usize>,
    next_handle: usize,
    contexts: HashMap<usize, Ctx>,
    primary: Vec<Option<usize>>,
    streams: HashMap<usize, Stream>,
    events: HashMap<usize, Event>,
    pools: HashMap<usize, Pool>,
    default_pool: Vec<usize>,
    pub(crate) allocs: BTreeMap<u64, Alloc>,
    freed: BTreeMap<u64, u64>,
    next_addr: Vec<u64>,
    used: Vec<u64>,
    poisoned: Vec<Option<CUresult>>,
    /// Each GPU's L2 (by scenario index): what its work touched last (`l2`).
    pub(crate) l2: Vec<l2::L2>,
    /// Bytes of traffic the launch running now has made before the load being served: a line
    /// the launch itself pushed out is read from memory.
    pub(crate) l2_since: u64,
    counts: Vec<HashMap<FaultOn, u64>>,
    busy: HashMap<Engine, f64>,
    /// The host's present in virtual seconds: how far it has waited (a synchronize moves it to
    /// the work it waited for). Work queued on an idle stream starts then, not at the stream's
    /// last completion, as on a real GPU where an idle stream's next copy starts when issued.
    now: f64,
    pinned: BTreeMap<usize, (usize, std::alloc::Layout)>,
    pub(crate) blas: HashMap<usize, blas::BlasHandle>,
    /// Loaded modules: their context and the kernels their PTX declares.
    modules: HashMap<usize, Module>,
    /// Function handles: (module, kernel name).
    functions: HashMap<usize, (usize, String)>,
    /// Spin kernels (`phq_spin`) waiting for their host flag.
    pub(crate) gates: Vec<kernels::Gate>,
    /// GEMM inputs already scanned for period 17 (`blas::periodic_table`): the snapshot, its
    /// offset, whether it is periodic.
    pub(crate) periodic: Vec<blas::Scanned>,
    /// Every fault an interpreted kernel raised, in order (tests read them; each was also
    /// printed on stderr).
    pub kernel_faults: Vec<interp::Fault>,
}

struct Module {
    ctx: usize,
    ptx: Arc<ptx::Module>,
}

static WORLD: Mutex<Option<Result<World, CUresult>>> = Mutex::new(None);

thread_local! {
    /// The calling thread's current context: contexts are current per host thread (DRV,
    /// cuCtxSetCurrent: "binds the specified CUDA context to the calling CPU thread").
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn lock() -> MutexGuard<'static, Option<Result<World, CUresult>>> {
    WORLD.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on the initialised world; before `cuInit`, every call answers
/// CUDA_ERROR_NOT_INITIALIZED (DRV, cuInit: "must be called before any other function from
/// the driver API").
pub(crate) fn with<F: FnOnce(&mut World) -> CUresult>(f: F) -> CUresult {
    let mut g = lock();
    match g.as_mut() {
        Some(Ok(w)) => f(w),
        Some(Err(_)) | None => NOT_INITIALIZED,
    }
}

fn current() -> usize {
    CURRENT.with(|c| c.get())
}

fn load_world() -> Result<World, CUresult> {
    let path = std::env::var("PHQ_FAKE_CUDA_SCENARIO").map_err(|_| {
        eprintln!("fake-cuda: PHQ_FAKE_CUDA_SCENARIO is not set");
        NOT_INITIALIZED
    })?;
    let text = std::fs::read_to_string(&path).map_err(|e| {
        eprintln!("fake-cuda: {path}: {e}");
        NOT_INITIALIZED
    })?;
    let scenario: Scenario = serde_json::from_str(&text).map_err(|e| {
        eprintln!("fake-cuda: {path}: {e}");
        NOT_INITIALIZED
    })?;
    if let Some(name) = &scenario.init_error {
        return Err(by_name(name).unwrap_or_else(|| {
            eprintln!("fake-cuda: {path}: unknown init_error {name}");
            NOT_INITIALIZED
        }));
    }
    World::new(scenario)
}

impl World {
    /// The driver's state for `scenario`, as `cuInit` leaves it.
    pub(crate) fn new(scenario: Scenario) -> Result<World, CUresult> {
        if scenario.devices.is_empty() {
            return Err(NO_DEVICE);
        }
        // CUDA_DEVICE_ORDER is read when the driver initialises: FASTEST_FIRST (the default) puts
        // the fastest device first by an unspecified heuristic, PCI_BUS_ID orders by PCI bus id as
        // nvidia-smi does (PG, "CUDA Environment Variables"). Setting it after cuInit changes nothing.
        let mut order: Vec<usize> = (0..scenario.devices.len()).collect();
        let by_pci = std::env::var("CUDA_DEVICE_ORDER").as_deref() == Ok("PCI_BUS_ID");
        order.sort_by(|&a, &b| {
            let (da, db) = (&scenario.devices[a], &scenario.devices[b]);
            let rank = |d: &scenario::Device| if by_pci { 0 } else { d.fastest_first_rank.unwrap_or(usize::MAX) };
            rank(da).cmp(&rank(db)).then(da.pci_bus_id.cmp(&db.pci_bus_id))
        });
        let n = scenario.devices.len();
        let mut w = World {
            scenario,
            order,
            next_handle: 0x1000,
            contexts: HashMap::new(),
            primary: vec![None; n],
            streams: HashMap::new(),
            events: HashMap::new(),
            pools: HashMap::new(),
            default_pool: Vec::new(),
            allocs: BTreeMap::new(),
            freed: BTreeMap::new(),
            next_addr: (0..n as u64).map(|d| BASE + d * SPAN).collect(),
            used: vec![0; n],
            poisoned: vec![None; n],
            l2: Vec::new(),
            l2_since: 0,
            counts: vec![HashMap::new(); n],
            busy: HashMap::new(),
            now: 0.0,
            pinned: BTreeMap::new(),
            gates: Vec::new(),
            periodic: Vec::new(),
            kernel_faults: Vec::new(),
            blas: HashMap::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
        };
        for d in 0..n {
            let h = w.handle();
            w.pools.insert(h, Pool { device: d, access: Vec::new() });
            w.l2.push(l2::L2::new(w.scenario.devices[d].l2_bytes));
            w.default_pool.push(h);
        }
        Ok(w)
    }
}

impl World {
    fn handle(&mut self) -> usize {
        self.next_handle += 0x10;
        self.next_handle
    }

    fn device(&self, ordinal: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(ordinal).ok().and_then(|o| self.order.get(o).copied()).ok_or(INVALID_DEVICE)
    }

    fn spec(&self, dev: usize) -> &scenario::Device {
        &self.scenario.devices[dev]
    }

    fn ordinal_of(&self, dev: usize) -> usize {
        self.order.iter().position(|&d| d == dev).unwrap_or(0)
    }

    /// The calling thread's current context, which must exist and not be poisoned.
    fn current_ctx(&self) -> Result<usize, CUresult> {
        let c = current();
        let ctx = self.contexts.get(&c).ok_or(INVALID_CONTEXT)?;
        self.healthy(ctx.device)?;
        Ok(c)
    }

    /// A sticky error stays with the context that met it until the process ends (DRV,
    /// `CUresult`, CUDA_ERROR_ILLEGAL_ADDRESS: "any further CUDA work will return the same
    /// error. To continue using CUDA, the process must be terminated and relaunched").
    fn healthy(&self, dev: usize) -> Result<(), CUresult> {
        match self.poisoned[dev] {
            Some(code) => Err(code),
            None => Ok(()),
        }
    }

    /// The stream's context; the null stream is the current context's default stream.
    fn stream(&self, s: Handle) -> Result<usize, CUresult> {
        let id = if s.is_null() {
            let c = self.current_ctx()?;
            self.contexts[&c].default_stream
        } else {
            s as usize
        };
        let st = self.streams.get(&id).ok_or(INVALID_HANDLE)?;
        self.healthy(self.contexts[&st.ctx].device)?;
        Ok(id)
    }

    fn stream_device(&self, s: usize) -> usize {
        self.contexts[&self.streams[&s].ctx].device
    }

    /// The live allocation holding `[ptr, ptr + len)`. A pointer into memory already freed, or
    /// into no allocation, is CUDA_ERROR_INVALID_VALUE, as the real driver answers when its
    /// unified-address lookup finds no allocation (DRV, cuMemcpy*: "CUDA_ERROR_INVALID_VALUE").
    pub(crate) fn find(&self, ptr: CUdeviceptr, len: u64) -> Result<(u64, usize), CUresult> {
        if let Some((&base, a)) = self.allocs.range(..=ptr).next_back() {
            let end = base + a.len as u64;
            if ptr >= base && ptr.checked_add(len).is_some_and(|e| e <= end) {
                return Ok((base, (ptr - base) as usize));
            }
        }
        if let Some((&base, &l)) = self.freed.range(..=ptr).next_back() {
            if ptr < base + l {
                eprintln!("fake-cuda: {ptr:#x} lies in memory freed earlier (use after free)");
            }
        }
        Err(INVALID_VALUE)
    }

    /// `find` for a kernel's access: the allocation's base, without a word on stderr.
    pub(crate) fn find_quiet(&self, ptr: CUdeviceptr, len: u64) -> Option<u64> {
        let (&base, a) = self.allocs.range(..=ptr).next_back()?;
        (ptr.checked_add(len).is_some_and(|e| e <= base + a.len as u64)).then_some(base)
    }

    /// Whether `ptr` lies in memory freed earlier.
    pub(crate) fn freed_at(&self, ptr: CUdeviceptr) -> bool {
        self.freed.range(..=ptr).next_back().is_some_and(|(&base, &l)| ptr < base + l)
    }

    /// Virtual seconds at which the work queued on `stream` so far starts its next item.
    pub(crate) fn stream_clock(&self, stream: usize) -> f64 {
        self.streams.get(&stream).map(|s| s.clock.max(self.now)).unwrap_or(self.now)
    }

    /// Counts an operation of `kind` on `dev` and fires the scenario's fault for it, if any:
    /// a sticky error poisons the device's context and is returned by later calls (work is
    /// asynchronous: the call that queued it succeeds); any other error is this call's answer.
    fn fault(&mut self, dev: usize, kind: FaultOn) -> Result<(), CUresult> {
        let counts = &mut self.counts[dev];
        let n_kind = *counts.entry(kind).and_modify(|c| *c += 1).or_insert(1) - 1;
        let n_any = *counts.entry(FaultOn::Any).and_modify(|c| *c += 1).or_insert(1) - 1;
        let hit = self.scenario.devices[dev]
            .faults
            .iter()
            .find(|f| (f.on == kind && f.after == n_kind) || (f.on == FaultOn::Any && f.after == n_any))
            .map(|f| f.error.clone());
        let Some(name) = hit else { return Ok(()) };
        let code = by_name(&name).unwrap_or(codes::INVALID_VALUE);
        if is_sticky(code) {
            self.poisoned[dev] = Some(code);
            Ok(())
        } else {
            Err(code)
        }
    }

    /// Occupies `stream` and `engines` for `secs` from when both are free; returns the end.
    fn occupy(&mut self, stream: usize, engines: &[Engine], secs: f64) {
        let st = &self.streams[&stream];
        let start =
            engines.iter().map(|e| self.busy.get(e).copied().unwrap_or(0.0)).fold(st.clock.max(self.now), f64::max);
        let end = start + secs;
        for e in engines {
            self.busy.insert(*e, end);
        }
        if let Some(st) = self.streams.get_mut(&stream) {
            st.clock = end;
        }
    }

    pub(crate) fn read(&mut self, ptr: CUdeviceptr, len: usize) -> Result<Vec<u8>, CUresult> {
        let mut out = vec![0u8; len];
        self.read_into(ptr, &mut out)?;
        Ok(out)
    }

    /// Reads `dst.len()` bytes at `ptr` into `dst`: what was written, but a stuck bit's cell
    /// reads its fixed value unless its line is still dirty in the GPU's L2 (`l2`).
    pub(crate) fn read_into(&mut self, ptr: CUdeviceptr, dst: &mut [u8]) -> Result<(), CUresult> {
        let (base, off) = self.find(ptr, dst.len() as u64)?;
        blas::materialise(self, base, off, dst.len());
        let a = &self.allocs[&base];
        a.read_into(off, dst);
        let dev = a.device;
        self.apply_stuck(dev, ptr, dst);
        Ok(())
    }

    /// Gives the stuck bits of GPU `dev` inside `[ptr, ptr + dst.len())` their fixed values,
    /// where the byte is read from its cell rather than from a dirty line of the L2.
    pub(crate) fn apply_stuck(&self, dev: usize, ptr: CUdeviceptr, dst: &mut [u8]) {
        let dev_base = BASE + dev as u64 * SPAN;
        let start = ptr - dev_base;
        for b in self.scenario.devices[dev].stuck_bits.iter() {
            if b.offset >= start && b.offset < start + dst.len() as u64 {
                if self.l2_line(dev_base + b.offset) == l2::Line::Dirty {
                    continue;
                }
                let byte = &mut dst[(b.offset - start) as usize];
                let mask = 1u8 << (b.bit & 7);
                *byte = if b.value != 0 { *byte | mask } else { *byte & !mask };
            }
        }
    }

    /// Whether any stuck bit of GPU `dev` lies in `[ptr, ptr + len)`.
    fn stuck_in(&self, dev: usize, ptr: CUdeviceptr, len: usize) -> bool {
        let start = ptr - (BASE + dev as u64 * SPAN);
        self.scenario.devices[dev].stuck_bits.iter().any(|b| b.offset >= start && b.offset < start + len as u64)
    }

    /// Where the byte at device address `addr` stands in its GPU's L2.
    pub(crate) fn l2_line(&self, addr: u64) -> l2::Line {
        let dev = ((addr.saturating_sub(BASE)) / SPAN) as usize;
        self.l2.get(dev).map_or(l2::Line::Memory, |c| c.line(addr, self.l2_since))
    }

    /// Enters work on `[ptr, ptr + len)` in the L2 of the GPU owning it (`l2::L2::touch`).
    pub(crate) fn l2_touch(&mut self, ptr: u64, len: u64, traffic: u64, write: bool, descending: bool) {
        let dev = ((ptr.saturating_sub(BASE)) / SPAN) as usize;
        if let Some(c) = self.l2.get_mut(dev) {
            c.touch(ptr, ptr + len, traffic, write, descending);
        }
    }

    pub(crate) fn write(&mut self, ptr: CUdeviceptr, bytes: &[u8]) -> Result<(), CUresult> {
        if let Some(word) = uniform_word(bytes) {
            return self.fill(ptr, bytes.len(), word);
        }
        self.write_with(ptr, bytes.len(), |dst, at| dst.copy_from_slice(&bytes[at..at + dst.len()]))
    }

    /// Writes `len` bytes of the repeated `word` at `ptr` (4-byte phase from `ptr`).
    pub(crate) fn fill(&mut self, ptr: CUdeviceptr, len: usize, word: u32) -> Result<(), CUresult> {
        let (base, off) = self.find(ptr, len as u64)?;
        if off == 0 && len == self.allocs[&base].len {
            blas::overwrite(self, base, off, len);
            let a = self.allocs.get_mut(&base).ok_or(INVALID_VALUE)?;
            a.mem = Mem::Fill(word);
            a.generation += 1;
            return Ok(());
        }
        self.write_with(ptr, len, |dst, at| fill_pattern(dst, word, at % 4))
    }

    /// Copies `len` bytes from `src` to `dst` (device memory, any devices).
    pub(crate) fn copy(&mut self, dst: CUdeviceptr, src: CUdeviceptr, len: usize) -> Result<(), CUresult> {
        let (sbase, soff) = self.find(src, len as u64)?;
        blas::materialise(self, sbase, soff, len);
        if let Mem::Fill(w) = self.allocs[&sbase].mem {
            // The word as it starts at `src`.
            let b = w.to_le_bytes();
            let p = soff % 4;
            let rotated = u32::from_le_bytes([b[p], b[(p + 1) % 4], b[(p + 2) % 4], b[(p + 3) % 4]]);
            return self.fill(dst, len, rotated);
        }
        let (dbase, _) = self.find(dst, len as u64)?;
        if dbase == sbase {
            // Within one allocation: read all before writing any, as memmove would.
            let bytes = self.read(src, len)?;
            return self.write(dst, &bytes);
        }
        // A step at a time, so a copy of a sparse buffer never holds more than a step of it.
        const STEP: usize = 64 << 20;
        let mut at = 0;
        while at < len {
            let n = STEP.min(len - at);
            let bytes = self.read(src + at as u64, n)?;
            self.write(dst + at as u64, &bytes)?;
            at += n;
        }
        Ok(())
    }

    pub(crate) fn write_with(
        &mut self,
        ptr: CUdeviceptr,
        len: usize,
        fill: impl FnMut(&mut [u8], usize),
    ) -> Result<(), CUresult> {
        let (base, off) = self.find(ptr, len as u64)?;
        blas::overwrite(self, base, off, len);
        // Memory keeps what was written; a stuck bit shows when its cell is read (`read_into`).
        let a = self.allocs.get_mut(&base).ok_or(INVALID_VALUE)?;
        a.write_with(off, len, fill);
        a.generation += 1;
        Ok(())
    }

    /// Whether `dev`'s work can touch `ptr` (on `owner`) directly: its own memory, or a peer's
    /// with access enabled from `ctx` — for pool memory, granted on the pool instead. Memory
    /// pool allocations "do not follow cuCtxEnablePeerAccess"; cuMemPoolSetAccess decides who
    /// may access them (PG, "Stream Ordered Memory Allocator", device accessibility for
    /// multi-GPU support).
    fn reaches(&self, ctx: usize, owner_base: u64) -> bool {
        let c = &self.contexts[&ctx];
        let a = &self.allocs[&owner_base];
        if a.device == c.device {
            return true;
        }
        if a.pool {
            let pool = self.default_pool[a.device];
            return self.pools[&pool].access.contains(&c.device);
        }
        c.peers.contains(&a.device)
    }

    /// Copies `len` bytes between two device pointers on `stream`, at the rate of the path the
    /// real driver takes: the GPU's HBM for a local copy; the peer link when the stream's
    /// context reaches the other GPU's memory; otherwise staged through host memory. Without
    /// peer access "the copy is staged through the host" and is slower (PG, "Peer-to-Peer
    /// Memory Copy"): here at the slower of the source's device→host and the destination's
    /// host→device rate.
    fn copy_dd(&mut self, dst: CUdeviceptr, src: CUdeviceptr, len: usize, stream: usize) -> CUresult {
        let (src_base, _) = match self.find(src, len as u64) {
            Ok(x) => x,
            Err(e) => return e,
        };
        let (dst_base, _) = match self.find(dst, len as u64) {
            Ok(x) => x,
            Err(e) => return e,
        };
        let (sd, dd) = (self.allocs[&src_base].device, self.allocs[&dst_base].device);
        let sdev = self.stream_device(stream);
        if let Err(e) = self.fault(sdev, FaultOn::Memcpy) {
            return e;
        }
        let ctx = self.streams[&stream].ctx;
        let (access, gbps) = self.scenario.peer(sd, dd);
        let other = if sdev == sd { dst_base } else { src_base };
        let direct = sd != dd && access && gbps > 0.0 && self.reaches(ctx, other);
        // Over a pair whose P2P writes are lost (`Pair::lost`) the copy takes its time and the
        // destination keeps what it held.
        if !(direct && self.scenario.lost(sd, dd)) {
            if let Err(e) = self.copy(dst, src, len) {
                return e;
            }
        }
        self.l2_touch(src, len as u64, len as u64, false, false);
        self.l2_touch(dst, len as u64, len as u64, true, false);
        let n = len as f64;
        if sd == dd {
            let secs = 2.0 * n / (self.spec(sd).hbm_gbps * 1e9);
            self.occupy(stream, &[Engine::Hbm(sd)], secs);
        } else if direct {
            self.occupy(stream, &[Engine::Link(sd, dd)], n / (gbps * 1e9));
        } else {
            let rate = self.staged_gbps(sd, dd);
            self.occupy(stream, &[Engine::DeviceToHost(sd), Engine::HostToDevice(dd)], n / (rate * 1e9));
        }
        SUCCESS
    }

    /// The rate of a copy from `sd` to `dd` staged through host memory: the slower of the
    /// source's device→host and the destination's host→device rate.
    pub(crate) fn staged_gbps(&self, sd: usize, dd: usize) -> f64 {
        self.spec(sd).d2h_gbps.min(self.spec(dd).h2d_gbps)
    }

    fn trace_context(&self, dev: usize) {
        // Stands in for what nvidia-smi would show: every GPU this process holds a context on.
        if let Ok(path) = std::env::var("PHQ_FAKE_CUDA_CONTEXTS") {
            use std::io::Write;
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                let _ = writeln!(f, "{}", self.spec(dev).pci_bus_id);
            }
        }
    }

    fn destroy_context(&mut self, ctx: usize) {
        let Some(c) = self.contexts.remove(&ctx) else { return };
        let dead: Vec<u64> = self.allocs.iter().filter(|(_, a)| a.ctx == ctx).map(|(b, _)| *b).collect();
        for b in dead {
            if let Some(a) = self.allocs.remove(&b) {
                self.used[a.device] = self.used[a.device].saturating_sub(a.len as u64);
                self.freed.insert(b, a.len as u64);
            }
        }
        self.streams.retain(|_, s| s.ctx != ctx);
        self.events.retain(|_, e| e.ctx != ctx);
        self.blas.retain(|_, b| b.ctx != ctx);
        self.used[c.device] = self.used[c.device].saturating_sub(self.spec(c.device).context_bytes);
        if self.primary[c.device] == Some(ctx) {
            self.primary[c.device] = None;
        }
    }

    fn alloc(&mut self, ctx: usize, bytes: usize, pool: bool) -> Result<CUdeviceptr, CUresult> {
        let dev = self.contexts[&ctx].device;
        self.fault(dev, FaultOn::Alloc)?;
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        let total = self.spec(dev).memory_bytes;
        if self.used[dev].saturating_add(bytes as u64) > total {
            return Err(OUT_OF_MEMORY);
        }
        let base = self.next_addr[dev];
        self.next_addr[dev] = base + (bytes as u64).div_ceil(ALIGN) * ALIGN;
        self.used[dev] += bytes as u64;
        self.allocs.insert(
            base,
            Alloc {
                base,
                device: dev,
                ctx,
                len: bytes,
                mem: Mem::Fill(0),
                pool,
                generation: 0,
                snapshot: None,
                pending: None,
            },
        );
        Ok(base)
    }

    fn free(&mut self, ptr: CUdeviceptr) -> CUresult {
        match self.allocs.get(&ptr) {
            Some(a) => {
                if let Err(e) = self.healthy(a.device) {
                    return e;
                }
            }
            None => return INVALID_VALUE,
        }
        if let Some(a) = self.allocs.remove(&ptr) {
            self.used[a.device] = self.used[a.device].saturating_sub(a.len as u64);
            self.freed.insert(ptr, a.len as u64);
        }
        SUCCESS
    }

    fn memset(&mut self, ptr: CUdeviceptr, value: &[u8], count: usize, stream: Handle) -> CUresult {
        let s = match self.stream(stream) {
            Ok(s) => s,
            Err(e) => return e,
        };
        let len = value.len() * count;
        let dev = match self.find(ptr, len as u64) {
            Ok((base, _)) => self.allocs[&base].device,
            Err(e) => return e,
        };
        if let Err(e) = self.fault(dev, FaultOn::Memset) {
            return e;
        }
        // D8 repeats one byte, D32 one word: either is a repeated 32-bit word.
        let word = match value.len() {
            1 => u32::from_le_bytes([value[0]; 4]),
            _ => u32::from_le_bytes([value[0], value[1], value[2], value[3]]),
        };
        let r = self.fill(ptr, len, word);
        if let Err(e) = r {
            return e;
        }
        self.l2_touch(ptr, len as u64, len as u64, true, false);
        // A memset writes every byte once.
        let secs = len as f64 / (self.spec(dev).hbm_gbps * 1e9);
        self.occupy(s, &[Engine::Hbm(dev)], secs);
        SUCCESS
    }
}

// ---------------------------------------------------------------------------------------------
// The exported functions, by the driver API reference's own groups. Pointer arguments are the
// caller's; every one is checked for null first.
// ---------------------------------------------------------------------------------------------
pub mod driver;
pub mod launch;
pub mod memory;
pub mod peer;
pub mod streams;
pub use driver::*;
pub use launch::*;
pub use memory::*;
pub use peer::*;
pub use streams::*;

impl World {
    /// Runs `secs` of SM work on `stream`'s GPU.
    pub(crate) fn run_on_sms(&mut self, stream: usize, secs: f64) {
        let dev = self.stream_device(stream);
        self.occupy(stream, &[Engine::Sm(dev), Engine::Hbm(dev)], secs);
    }

    pub(crate) fn ctx_dev(&self, ctx: usize) -> usize {
        self.contexts[&ctx].device
    }

    pub(crate) fn hbm_gbps(&self, dev: usize) -> f64 {
        self.spec(dev).hbm_gbps
    }

    pub(crate) fn gemm_wrong(&self, dev: usize) -> Vec<(usize, usize)> {
        self.spec(dev).gemm_wrong_entries.iter().map(|e| (e[0], e[1])).collect()
    }

    pub(crate) fn sm_copy_gbps(&self, dev: usize) -> f64 {
        self.spec(dev).sm_copy_gbps.unwrap_or(self.spec(dev).hbm_gbps)
    }

    /// Seconds one dependent load from `dev`'s kernel takes: of host memory (`None`), its own
    /// memory, or a peer's.
    pub(crate) fn latency_s(&self, dev: usize, owner: Option<usize>) -> f64 {
        let ns = match owner {
            None => self.spec(dev).host_latency_ns,
            Some(o) if o == dev => self.spec(dev).hbm_latency_ns,
            Some(_) => self.scenario.peers.latency_ns,
        };
        ns * 1e-9
    }

    /// What a dependent load from `dev` of device memory at `addr` (on `owner`) costs: served
    /// by the owner's L2 while the line is there (device memory is coherent at its own GPU's
    /// L2: PTX ISA, "Cache Operators", `.cv`), from its memory otherwise. A peer's L2 hit still
    /// crosses the link: the peer figure with the memory's share replaced by the L2's.
    pub(crate) fn device_latency_s(&self, dev: usize, owner: usize, addr: u64) -> f64 {
        let memory = self.latency_s(dev, Some(owner));
        if self.l2_line(addr) == l2::Line::Memory {
            return memory;
        }
        let o = self.spec(owner);
        let hit = if owner == dev {
            o.l2_latency_ns
        } else {
            (self.scenario.peers.latency_ns - o.hbm_latency_ns + o.l2_latency_ns).max(o.l2_latency_ns)
        };
        hit * 1e-9
    }
}

/// For tests of the fake itself: a C string's text.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string.
pub unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the driver's names are NUL-terminated static strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The handle of a GEMM's device: what `blas` needs from the world.
impl World {
    pub(crate) fn default_stream_of(&self, ctx: usize) -> Option<usize> {
        self.contexts.get(&ctx).map(|c| c.default_stream)
    }
    pub(crate) fn stream_exists(&self, s: usize) -> bool {
        self.streams.contains_key(&s)
    }
    pub(crate) fn ctx_device(&self, ctx: usize) -> Option<usize> {
        self.contexts.get(&ctx).map(|c| c.device)
    }
    pub(crate) fn current_ctx_pub(&self) -> Result<usize, CUresult> {
        self.current_ctx()
    }
    /// Whether `[ptr, ptr + len)` lies in one page-locked host allocation (which kernels may
    /// reach through its unified address).
    pub(crate) fn host_mapped(&self, ptr: u64, len: u64) -> bool {
        self.pinned
            .range(..=(ptr as usize))
            .next_back()
            .is_some_and(|(&base, &(bytes, _))| ptr.checked_add(len).is_some_and(|end| end <= (base + bytes) as u64))
    }

    pub(crate) fn new_handle(&mut self) -> usize {
        self.handle()
    }
    pub(crate) fn reaches_ptr(&self, ctx: usize, ptr: CUdeviceptr, len: u64) -> Result<bool, CUresult> {
        let (base, _) = self.find(ptr, len)?;
        Ok(self.reaches(ctx, base))
    }
    pub(crate) fn poison(&mut self, dev: usize, code: CUresult) {
        self.poisoned[dev] = Some(code);
    }
    pub(crate) fn gemm_fault(&mut self, dev: usize) -> Result<(), CUresult> {
        self.fault(dev, FaultOn::Gemm)
    }
    pub(crate) fn run_on_sm(&mut self, stream: usize, dev: usize, secs: f64) {
        self.occupy(stream, &[Engine::Sm(dev)], secs);
    }
    pub(crate) fn sgemm_tflops(&self, dev: usize) -> f64 {
        self.spec(dev).sgemm_tflops
    }
    pub(crate) fn healthy_dev(&self, dev: usize) -> Result<(), CUresult> {
        self.healthy(dev)
    }
    /// The bytes of the allocation at `base` as of now, shared until it is next written.
    pub(crate) fn snapshot(&mut self, base: u64) -> Arc<Vec<u8>> {
        let len = self.allocs[&base].len;
        blas::materialise(self, base, 0, len);
        let a = &self.allocs[&base];
        if let Some((g, s)) = &a.snapshot {
            if *g == a.generation {
                return s.clone();
            }
        }
        let mut bytes = vec![0u8; len];
        a.read_into(0, &mut bytes);
        let (generation, dev) = (a.generation, a.device);
        // What the GPU reads: stuck bits included.
        self.apply_stuck(dev, base, &mut bytes);
        let s = Arc::new(bytes);
        if let Some(a) = self.allocs.get_mut(&base) {
            a.snapshot = Some((generation, s.clone()));
        }
        s
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ptx;
#[cfg(test)]
mod tests_sampled;
