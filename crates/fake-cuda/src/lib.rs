//! fake-cuda: a working stand-in for `libcuda.so.1` that keeps the CUDA driver API's rules.
//!
//! It exports the driver API functions the agent calls (and those cudarc calls, so an older
//! build can be run against it too) and answers them from the JSON scenario named by
//! `PHQ_FAKE_CUDA_SCENARIO`, read at `cuInit` (docs/fake-cuda-scenario.md). Device memory lives
//! in host RAM; time is virtual: every copy, memset or GEMM occupies its stream and the engine
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
pub mod interp;
pub mod kernels;
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

/// Device memory as the fake stores it: one repeated 32-bit word (a fresh allocation, a
/// whole-buffer memset, a copy of such a buffer) until something writes less than all of it,
/// then its bytes. Storage only: a read sees the same bytes either way. It keeps an 8-GPU run
/// from needing gigabytes of host RAM and hours of memcpy for buffers nobody looks into.
pub(crate) enum Mem {
    Fill(u32),
    Bytes(Vec<u8>),
    /// Every 64-bit word holds `kernels::pattern(its address, mode, arg)`: what the memory-test
    /// kernels write over a whole allocation (address in address, random words) without the
    /// fake holding its bytes.
    Pattern {
        mode: u32,
        arg: u64,
    },
}

/// Writes the bytes of pattern memory from device address `addr` into `dst`.
pub(crate) fn pattern_bytes(dst: &mut [u8], addr: u64, mode: u32, arg: u64) {
    for (i, b) in dst.iter_mut().enumerate() {
        let a = addr + i as u64;
        *b = kernels::pattern(a & !7, mode, arg).to_le_bytes()[(a & 7) as usize];
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
    let rest = &mut dst[lead..];
    let mut chunks = rest.chunks_exact_mut(4);
    for c in &mut chunks {
        c.copy_from_slice(&b);
    }
    for (i, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x = b[i];
    }
}

/// The word whose repetition `bytes` is, if it is one (aligned at `bytes[0]`).
fn uniform_word(bytes: &[u8]) -> Option<u32> {
    if bytes.len() < 4 || !bytes.len().is_multiple_of(4) {
        return None;
    }
    let first = &bytes[..4];
    bytes.chunks_exact(4).all(|c| c == first).then(|| u32::from_le_bytes([first[0], first[1], first[2], first[3]]))
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
            Mem::Bytes(v) => dst.copy_from_slice(&v[off..off + dst.len()]),
            Mem::Fill(w) => fill_pattern(dst, *w, off % 4),
            Mem::Pattern { mode, arg } => pattern_bytes(dst, self.base + off as u64, *mode, *arg),
        }
    }

    /// The bytes, materialised from the repeated word or the pattern on first need.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        if !matches!(self.mem, Mem::Bytes(_)) {
            let mut v = vec![0u8; self.len];
            self.read_into(0, &mut v);
            self.mem = Mem::Bytes(v);
        }
        match &mut self.mem {
            Mem::Bytes(v) => v,
            Mem::Fill(_) | Mem::Pattern { .. } => &mut [],
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

    /// Reads `dst.len()` bytes at `ptr` into `dst`.
    pub(crate) fn read_into(&mut self, ptr: CUdeviceptr, dst: &mut [u8]) -> Result<(), CUresult> {
        let (base, off) = self.find(ptr, dst.len() as u64)?;
        blas::materialise(self, base, off, dst.len());
        let a = &self.allocs[&base];
        a.read_into(off, dst);
        // Written bytes carry their stuck bits already (`write_with`); pattern memory gets them
        // as it is read.
        if matches!(a.mem, Mem::Pattern { .. }) {
            let dev_base = BASE + a.device as u64 * SPAN;
            let start = ptr - dev_base;
            for b in self.scenario.devices[a.device].stuck_bits.iter() {
                if b.offset >= start && b.offset < start + dst.len() as u64 {
                    let byte = &mut dst[(b.offset - start) as usize];
                    let mask = 1u8 << (b.bit & 7);
                    *byte = if b.value != 0 { *byte | mask } else { *byte & !mask };
                }
            }
        }
        Ok(())
    }

    pub(crate) fn write(&mut self, ptr: CUdeviceptr, bytes: &[u8]) -> Result<(), CUresult> {
        if let Some(word) = uniform_word(bytes) {
            return self.fill(ptr, bytes.len(), word);
        }
        self.write_with(ptr, bytes.len(), |dst| dst.copy_from_slice(bytes))
    }

    /// Writes `len` bytes of the repeated `word` at `ptr` (4-byte phase from `ptr`).
    pub(crate) fn fill(&mut self, ptr: CUdeviceptr, len: usize, word: u32) -> Result<(), CUresult> {
        let (base, off) = self.find(ptr, len as u64)?;
        let dev = self.allocs[&base].device;
        let dev_base = BASE + dev as u64 * SPAN;
        let (start, end) = (ptr - dev_base, ptr - dev_base + len as u64);
        let stuck_inside = self.scenario.devices[dev].stuck_bits.iter().any(|b| b.offset >= start && b.offset < end);
        if off == 0 && len == self.allocs[&base].len && !stuck_inside {
            blas::overwrite(self, base, off, len);
            let a = self.allocs.get_mut(&base).ok_or(INVALID_VALUE)?;
            a.mem = Mem::Fill(word);
            a.generation += 1;
            return Ok(());
        }
        self.write_with(ptr, len, |dst| fill_pattern(dst, word, 0))
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
        if dbase == sbase || matches!(self.allocs[&sbase].mem, Mem::Pattern { .. }) {
            let bytes = self.read(src, len)?;
            return self.write(dst, &bytes);
        }
        // Borrow the source's bytes while the destination is written; put them back after.
        let a = self.allocs.get_mut(&sbase).ok_or(INVALID_VALUE)?;
        let taken = std::mem::replace(&mut a.mem, Mem::Fill(0));
        let r = match &taken {
            Mem::Bytes(v) => self.write_with(dst, len, |d| d.copy_from_slice(&v[soff..soff + len])),
            Mem::Fill(_) | Mem::Pattern { .. } => Ok(()),
        };
        if let Some(a) = self.allocs.get_mut(&sbase) {
            a.mem = taken;
        }
        r
    }

    pub(crate) fn write_with(
        &mut self,
        ptr: CUdeviceptr,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), CUresult> {
        let (base, off) = self.find(ptr, len as u64)?;
        blas::overwrite(self, base, off, len);
        let dev = self.allocs[&base].device;
        let dev_base = BASE + dev as u64 * SPAN;
        let a = self.allocs.get_mut(&base).ok_or(INVALID_VALUE)?;
        let data = a.bytes_mut();
        fill(&mut data[off..off + len]);
        // A stuck bit reads its fixed value whatever was written over it.
        let (start, end) = (ptr - dev_base, ptr - dev_base + len as u64);
        for b in self.scenario.devices[dev].stuck_bits.iter().filter(|b| b.offset >= start && b.offset < end) {
            let byte = &mut data[off + (b.offset - start) as usize];
            let mask = 1u8 << (b.bit & 7);
            *byte = if b.value != 0 { *byte | mask } else { *byte & !mask };
        }
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
        if let Err(e) = self.copy(dst, src, len) {
            return e;
        }
        let ctx = self.streams[&stream].ctx;
        let n = len as f64;
        if sd == dd {
            let secs = 2.0 * n / (self.spec(sd).hbm_gbps * 1e9);
            self.occupy(stream, &[Engine::Hbm(sd)], secs);
        } else {
            let (access, gbps) = self.scenario.peer(sd, dd);
            let other = if sdev == sd { dst_base } else { src_base };
            if access && gbps > 0.0 && self.reaches(ctx, other) {
                self.occupy(stream, &[Engine::Link(sd, dd)], n / (gbps * 1e9));
            } else {
                let rate = self.spec(sd).d2h_gbps.min(self.spec(dd).h2d_gbps);
                self.occupy(stream, &[Engine::DeviceToHost(sd), Engine::HostToDevice(dd)], n / (rate * 1e9));
            }
        }
        SUCCESS
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
        // A memset writes every byte once.
        let secs = len as f64 / (self.spec(dev).hbm_gbps * 1e9);
        self.occupy(s, &[Engine::Hbm(dev)], secs);
        SUCCESS
    }
}

// ---------------------------------------------------------------------------------------------
// Exported functions. Pointer arguments are the caller's; every one is checked for null first.
// ---------------------------------------------------------------------------------------------

/// # Safety
/// As the real cuInit.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    let mut g = lock();
    if g.is_none() {
        *g = Some(load_world());
    }
    match g.as_ref() {
        Some(Ok(_)) => SUCCESS,
        Some(Err(e)) => *e,
        None => NOT_INITIALIZED,
    }
}

/// Answers without cuInit, as the real one does.
///
/// # Safety
/// `v` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    if v.is_null() {
        return INVALID_VALUE;
    }
    let version = std::env::var("PHQ_FAKE_CUDA_SCENARIO")
        .ok()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|j| j.get("driver_version").and_then(|v| v.as_i64()))
        .unwrap_or(12080);
    *v = version as c_int;
    SUCCESS
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, out: *mut *const c_char) -> CUresult {
    error_text(code, out, true)
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, out: *mut *const c_char) -> CUresult {
    error_text(code, out, false)
}

unsafe fn error_text(code: CUresult, out: *mut *const c_char, name: bool) -> CUresult {
    static NAMES: std::sync::OnceLock<Vec<(CUresult, std::ffi::CString, std::ffi::CString)>> =
        std::sync::OnceLock::new();
    let table = NAMES.get_or_init(|| {
        TABLE
            .iter()
            .filter_map(|(c, n, t)| Some((*c, std::ffi::CString::new(*n).ok()?, std::ffi::CString::new(*t).ok()?)))
            .collect()
    });
    if out.is_null() {
        return INVALID_VALUE;
    }
    match table.iter().find(|(c, _, _)| *c == code) {
        Some((_, n, t)) => {
            *out = if name { n.as_ptr() } else { t.as_ptr() };
            SUCCESS
        }
        None => {
            *out = std::ptr::null();
            INVALID_VALUE
        }
    }
}

/// # Safety
/// `count` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    if count.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        *count = w.order.len() as c_int;
        SUCCESS
    })
}

/// # Safety
/// `dev` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(ordinal) {
        Ok(_) => {
            *dev = ordinal;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `name` must hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            write_c_string(&w.spec(d).name, name, len as usize);
            SUCCESS
        }
        Err(e) => e,
    })
}

unsafe fn write_c_string(s: &str, out: *mut c_char, len: usize) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(len - 1);
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, out, n);
    *out.add(n) = 0;
}

/// `0000:18:00.0` (DRV, cuDeviceGetPCIBusId: "[domain]:[bus]:[device].[function]").
///
/// # Safety
/// `out` must hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(out: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    if out.is_null() || len < 13 {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            write_c_string(&w.spec(d).pci_bus_id, out, len as usize);
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `bytes` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    if bytes.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            *bytes = w.spec(d).memory_bytes as usize;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `uuid` must hold 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut u8, dev: CUdevice) -> CUresult {
    if uuid.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            for i in 0..16 {
                *uuid.add(i) = (d as u8).wrapping_mul(31).wrapping_add(i as u8);
            }
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `uuid` must hold 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: CUdevice) -> CUresult {
    cuDeviceGetUuid(uuid, dev)
}

/// The attributes the agent and cudarc ask; any other valid attribute reads 0.
///
/// # Safety
/// `value` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    if value.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let d = match w.device(dev) {
            Ok(d) => d,
            Err(e) => return e,
        };
        let spec = w.spec(d);
        let bus = u32::from_str_radix(spec.pci_bus_id.get(5..7).unwrap_or("0"), 16).unwrap_or(0);
        *value = match attrib {
            1 => 1024, // MAX_THREADS_PER_BLOCK
            16 => 132, // MULTIPROCESSOR_COUNT (H100 SXM)
            20 => match spec.compute_mode {
                // COMPUTE_MODE
                ComputeMode::Default => 0,
                ComputeMode::Prohibited => 2,
                ComputeMode::ExclusiveProcess => 3,
            },
            33 => bus as c_int, // PCI_BUS_ID
            41 => 1,            // UNIFIED_ADDRESSING
            75 => 9,            // COMPUTE_CAPABILITY_MAJOR
            76 => 0,            // COMPUTE_CAPABILITY_MINOR
            115 => 1,           // MEMORY_POOLS_SUPPORTED
            a if (1..=150).contains(&a) => 0,
            _ => return INVALID_VALUE,
        };
        SUCCESS
    })
}

/// # Safety
/// `can` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult {
    if can.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let (a, b) = match (w.device(dev), w.device(peer)) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return INVALID_DEVICE,
        };
        *can = (a != b && w.scenario.peer(a, b).0) as c_int;
        SUCCESS
    })
}

/// Retains the device's primary context. In exclusive-process mode with another process on the
/// GPU, or in prohibited mode, no context can be made: CUDA_ERROR_DEVICE_UNAVAILABLE ("devices
/// are often unavailable due to use of CU_COMPUTEMODE_EXCLUSIVE_PROCESS or
/// CU_COMPUTEMODE_PROHIBITED", DRV, `CUresult`).
///
/// # Safety
/// `ctx` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: CUdevice) -> CUresult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let d = match w.device(dev) {
            Ok(d) => d,
            Err(e) => return e,
        };
        if let Some(h) = w.primary[d] {
            if let Some(c) = w.contexts.get_mut(&h) {
                c.refs += 1;
            }
            *ctx = h as Handle;
            return SUCCESS;
        }
        let spec = w.spec(d);
        if spec.compute_mode == ComputeMode::Prohibited
            || (spec.compute_mode == ComputeMode::ExclusiveProcess && spec.other_process)
        {
            return DEVICE_UNAVAILABLE;
        }
        if w.used[d] + spec.context_bytes > spec.memory_bytes {
            return OUT_OF_MEMORY;
        }
        w.used[d] += spec.context_bytes;
        let (h, s) = (w.handle(), w.handle());
        w.contexts.insert(h, Ctx { device: d, refs: 1, peers: Vec::new(), default_stream: s });
        w.streams.insert(s, Stream { ctx: h, clock: 0.0 });
        w.primary[d] = Some(h);
        w.trace_context(d);
        *ctx = h as Handle;
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    with(|w| {
        let d = match w.device(dev) {
            Ok(d) => d,
            Err(e) => return e,
        };
        let Some(h) = w.primary[d] else { return INVALID_CONTEXT };
        let refs = {
            let Some(c) = w.contexts.get_mut(&h) else { return INVALID_CONTEXT };
            c.refs -= 1;
            c.refs
        };
        if refs == 0 {
            w.destroy_context(h);
        }
        SUCCESS
    })
}

/// # Safety
/// `flags` and `active` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    if flags.is_null() || active.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            *flags = 0;
            *active = w.primary[d].is_some() as c_int;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// As the real one; a null context unbinds the thread.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    with(|w| {
        let h = ctx as usize;
        if h != 0 && !w.contexts.contains_key(&h) {
            return INVALID_CONTEXT;
        }
        CURRENT.with(|c| c.set(h));
        SUCCESS
    })
}

/// # Safety
/// `ctx` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> CUresult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let h = current();
        *ctx = if w.contexts.contains_key(&h) { h as Handle } else { std::ptr::null_mut() };
        SUCCESS
    })
}

/// # Safety
/// `dev` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.current_ctx() {
        Ok(c) => {
            *dev = w.ordinal_of(w.contexts[&c].device) as CUdevice;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// Work is done when it is queued, so synchronising only reports a sticky error.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    with(|w| match w.current_ctx() {
        Ok(c) => {
            kernels::settle_gates(w);
            let done = w.streams.values().filter(|s| s.ctx == c).map(|s| s.clock).fold(w.now, f64::max);
            w.now = done;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// Enables access from the current context to `peer`'s memory (DRV, cuCtxEnablePeerAccess):
/// CUDA_ERROR_INVALID_CONTEXT without a current context, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
/// when cuDeviceCanAccessPeer says no, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED the second time,
/// CUDA_ERROR_INVALID_VALUE for flags other than 0.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: Handle, flags: c_uint) -> CUresult {
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        if flags != 0 {
            return INVALID_VALUE;
        }
        let Some(p) = w.contexts.get(&(peer as usize)) else { return INVALID_HANDLE };
        let (me, them) = (w.contexts[&c].device, p.device);
        if me == them {
            return INVALID_DEVICE;
        }
        if !w.scenario.peer(me, them).0 {
            return PEER_ACCESS_UNSUPPORTED;
        }
        let Some(ctx) = w.contexts.get_mut(&c) else { return INVALID_CONTEXT };
        if ctx.peers.contains(&them) {
            return PEER_ACCESS_ALREADY_ENABLED;
        }
        ctx.peers.push(them);
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: Handle) -> CUresult {
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        let Some(them) = w.contexts.get(&(peer as usize)).map(|p| p.device) else { return INVALID_HANDLE };
        let Some(ctx) = w.contexts.get_mut(&c) else { return INVALID_CONTEXT };
        if !ctx.peers.contains(&them) {
            return PEER_ACCESS_NOT_ENABLED;
        }
        ctx.peers.retain(|d| *d != them);
        SUCCESS
    })
}

/// # Safety
/// `lo` and `hi` may be null.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(lo: *mut c_int, hi: *mut c_int) -> CUresult {
    if !lo.is_null() {
        *lo = 0;
    }
    if !hi.is_null() {
        *hi = -5;
    }
    SUCCESS
}

/// A stream belongs to the current context (DRV, cuStreamCreate).
///
/// # Safety
/// `s` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut Handle, _flags: c_uint) -> CUresult {
    if s.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        let h = w.handle();
        w.streams.insert(h, Stream { ctx: c, clock: 0.0 });
        *s = h as Handle;
        SUCCESS
    })
}

/// # Safety
/// `s` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(s: *mut Handle, flags: c_uint, _priority: c_int) -> CUresult {
    cuStreamCreate(s, flags)
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: Handle) -> CUresult {
    with(|w| {
        let id = s as usize;
        match w.streams.get(&id) {
            Some(st) if w.contexts.get(&st.ctx).is_some_and(|c| c.default_stream != id) => {
                w.streams.remove(&id);
                SUCCESS
            }
            _ => INVALID_HANDLE,
        }
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: Handle) -> CUresult {
    with(|w| match w.stream(s) {
        Ok(id) => {
            kernels::settle_gates(w);
            w.now = w.now.max(w.streams[&id].clock);
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(s: Handle) -> CUresult {
    cuStreamSynchronize(s)
}

/// A stream may wait on an event of another device ("cudaStreamWaitEvent() will succeed even
/// if the input stream and input event are associated to different devices", PG, "Stream and
/// Event Behavior"); its later work starts no earlier than the event's.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: Handle, e: Handle, _flags: c_uint) -> CUresult {
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let Some(ev) = w.events.get(&(e as usize)) else { return INVALID_HANDLE };
        let at = ev.at.unwrap_or(0.0);
        let now = w.now;
        if let Some(st) = w.streams.get_mut(&id) {
            st.clock = st.clock.max(at).max(now);
        }
        SUCCESS
    })
}

/// # Safety
/// `e` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut Handle, flags: c_uint) -> CUresult {
    if e.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        let h = w.handle();
        w.events.insert(h, Event { ctx: c, timing: flags & CU_EVENT_DISABLE_TIMING == 0, at: None });
        *e = h as Handle;
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: Handle) -> CUresult {
    with(|w| match w.events.remove(&(e as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    })
}

/// The event and the stream must belong to the same context: "cudaEventRecord() will fail if
/// the input event and input stream are associated to different devices" (PG, "Stream and
/// Event Behavior"); the driver answers CUDA_ERROR_INVALID_HANDLE.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: Handle, s: Handle) -> CUresult {
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let (sctx, clock) = (w.streams[&id].ctx, w.streams[&id].clock.max(w.now));
        let Some(ev) = w.events.get_mut(&(e as usize)) else { return INVALID_HANDLE };
        if ev.ctx != sctx {
            eprintln!("fake-cuda: cuEventRecord: the event and the stream belong to different contexts");
            return INVALID_HANDLE;
        }
        ev.at = Some(clock);
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: Handle) -> CUresult {
    with(|w| match w.events.get(&(e as usize)).map(|ev| (ev.ctx, ev.at)) {
        Some((ctx, at)) => match w.contexts.get(&ctx).map(|c| c.device) {
            Some(device) => {
                kernels::settle_gates(w);
                w.now = w.now.max(at.unwrap_or(0.0));
                w.healthy(device).err().unwrap_or(SUCCESS)
            }
            None => INVALID_HANDLE,
        },
        None => INVALID_HANDLE,
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: Handle) -> CUresult {
    cuEventSynchronize(e)
}

/// Milliseconds between two recorded events of one context (DRV, cuEventElapsedTime: an event
/// never recorded, or created with CU_EVENT_DISABLE_TIMING, is CUDA_ERROR_INVALID_HANDLE;
/// PG: "cudaEventElapsedTime() will fail if the two input events are associated to different
/// devices").
///
/// # Safety
/// `ms` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    if ms.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let (Some(a), Some(b)) = (w.events.get(&(start as usize)), w.events.get(&(end as usize))) else {
            return INVALID_HANDLE;
        };
        if a.ctx != b.ctx || !a.timing || !b.timing {
            return INVALID_HANDLE;
        }
        if let Some(c) = w.contexts.get(&a.ctx) {
            if let Err(e) = w.healthy(c.device) {
                return e;
            }
        }
        match (a.at, b.at) {
            (Some(x), Some(y)) => {
                *ms = ((y - x) * 1000.0) as f32;
                SUCCESS
            }
            _ => INVALID_HANDLE,
        }
    })
}

/// # Safety
/// `ms` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    cuEventElapsedTime(ms, start, end)
}

/// # Safety
/// `free` and `total` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.current_ctx() {
        Ok(c) => {
            let d = w.contexts[&c].device;
            *total = w.spec(d).memory_bytes as usize;
            *free = w.spec(d).memory_bytes.saturating_sub(w.used[d]) as usize;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `ptr` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        match w.alloc(c, bytes, false) {
            Ok(p) => {
                *ptr = p;
                SUCCESS
            }
            Err(e) => e,
        }
    })
}

/// Freeing twice, or a pointer no allocation returned, is CUDA_ERROR_INVALID_VALUE.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    with(|w| w.free(ptr))
}

/// Allocates from the stream's device's default pool (DRV, cuMemAllocAsync).
///
/// # Safety
/// `ptr` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(ptr: *mut CUdeviceptr, bytes: usize, s: Handle) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let c = w.streams[&id].ctx;
        match w.alloc(c, bytes, true) {
            Ok(p) => {
                *ptr = p;
                SUCCESS
            }
            Err(e) => e,
        }
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: CUdeviceptr, s: Handle) -> CUresult {
    with(|w| match w.stream(s) {
        Ok(_) => w.free(ptr),
        Err(e) => e,
    })
}

/// # Safety
/// `pool` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: CUdevice) -> CUresult {
    if pool.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            *pool = w.default_pool[d] as Handle;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `pool` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut Handle, dev: CUdevice) -> CUresult {
    cuDeviceGetDefaultMemPool(pool, dev)
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(pool: Handle, _attr: c_int, _value: *mut c_void) -> CUresult {
    with(|w| if w.pools.contains_key(&(pool as usize)) { SUCCESS } else { INVALID_HANDLE })
}

/// # Safety
/// `value` must hold a u64.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(pool: Handle, _attr: c_int, value: *mut c_void) -> CUresult {
    if value.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        if !w.pools.contains_key(&(pool as usize)) {
            return INVALID_HANDLE;
        }
        *(value as *mut u64) = 0;
        SUCCESS
    })
}

/// `CUmemAccessDesc`: a location (type, id) and the access flags.
#[repr(C)]
pub struct MemAccessDesc {
    pub location_type: c_int,
    pub location_id: c_int,
    pub flags: c_int,
}

/// Grants devices access to a pool's allocations (DRV, cuMemPoolSetAccess).
///
/// # Safety
/// `desc` must hold `count` descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAccess(pool: Handle, desc: *const MemAccessDesc, count: usize) -> CUresult {
    if desc.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let descs = std::slice::from_raw_parts(desc, count);
        let mut grant = Vec::new();
        for d in descs {
            // CU_MEM_LOCATION_TYPE_DEVICE = 1; CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3.
            if d.location_type != 1 {
                return INVALID_VALUE;
            }
            match w.device(d.location_id) {
                Ok(dev) => grant.push((dev, d.flags)),
                Err(e) => return e,
            }
        }
        let Some(p) = w.pools.get_mut(&(pool as usize)) else { return INVALID_HANDLE };
        for (dev, flags) in grant {
            p.access.retain(|x| *x != dev);
            if flags != 0 && dev != p.device {
                p.access.push(dev);
            }
        }
        SUCCESS
    })
}

/// Page-locked host memory for the current context (DRV, cuMemHostAlloc). Flags other than
/// CU_MEMHOSTALLOC_PORTABLE (1), DEVICEMAP (2) and WRITECOMBINED (4) are CUDA_ERROR_INVALID_VALUE.
///
/// # Safety
/// `pp` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, flags: c_uint) -> CUresult {
    if pp.is_null() || bytes == 0 || flags & !0x7 != 0 {
        return INVALID_VALUE;
    }
    with(|w| {
        if let Err(e) = w.current_ctx() {
            return e;
        }
        let Ok(layout) = std::alloc::Layout::from_size_align(bytes, 4096) else { return INVALID_VALUE };
        let p = std::alloc::alloc_zeroed(layout);
        if p.is_null() {
            return OUT_OF_MEMORY;
        }
        w.pinned.insert(p as usize, (bytes, layout));
        *pp = p as *mut c_void;
        SUCCESS
    })
}

/// The device pointer of page-locked host memory (DRV, cuMemHostGetDevicePointer): flags must be 0
/// (CUDA_ERROR_INVALID_VALUE otherwise); memory that is not from cuMemHostAlloc is
/// CUDA_ERROR_INVALID_VALUE. Under unified addressing every cuMemHostAlloc allocation is mapped
/// whatever its flags, and "the pointer value through which allocated host memory may be
/// accessed in kernels ... is the same as the pointer value through which that memory is
/// accessed on the host" (DRV, "Unified Addressing": automatic mapping of host allocated host
/// memory): the fake answers the host pointer.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    if out.is_null() || flags != 0 {
        return INVALID_VALUE;
    }
    with(|w| {
        if let Err(e) = w.current_ctx() {
            return e;
        }
        if !w.host_mapped(p as u64, 1) {
            return INVALID_VALUE;
        }
        *out = p as u64;
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    with(|w| match w.pinned.remove(&(p as usize)) {
        Some((_, layout)) => {
            std::alloc::dealloc(p as *mut u8, layout);
            SUCCESS
        }
        None => INVALID_VALUE,
    })
}

/// A host→device copy on the device's host→device copy engine. A copy may be queued on a
/// stream of another device: "a memory copy will succeed even if it is issued to a stream that
/// is not associated to the current device" (PG, "Stream and Event Behavior").
///
/// # Safety
/// `src` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: Handle) -> CUresult {
    if src.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let dev = match w.find(dst, n as u64) {
            Ok((b, _)) => w.allocs[&b].device,
            Err(e) => return e,
        };
        if let Err(e) = w.fault(dev, FaultOn::Memcpy) {
            return e;
        }
        let bytes = std::slice::from_raw_parts(src as *const u8, n);
        if let Err(e) = w.write(dst, bytes) {
            return e;
        }
        let secs = n as f64 / (w.spec(dev).h2d_gbps * 1e9);
        w.occupy(id, &[Engine::HostToDevice(dev)], secs);
        SUCCESS
    })
}

/// # Safety
/// `dst` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    if dst.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let dev = match w.find(src, n as u64) {
            Ok((b, _)) => w.allocs[&b].device,
            Err(e) => return e,
        };
        if let Err(e) = w.fault(dev, FaultOn::Memcpy) {
            return e;
        }
        if let Err(e) = w.read_into(src, std::slice::from_raw_parts_mut(dst as *mut u8, n)) {
            return e;
        }
        let secs = n as f64 / (w.spec(dev).d2h_gbps * 1e9);
        w.occupy(id, &[Engine::DeviceToHost(dev)], secs);
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    with(|w| match w.stream(s) {
        Ok(id) => w.copy_dd(dst, src, n, id),
        Err(e) => e,
    })
}

/// A copy between two contexts' memory (DRV, cuMemcpyPeerAsync). Direct over the peer link
/// when the stream's context reaches the other GPU's buffer; staged through host memory,
/// at PCIe speed, when it does not (see `copy_dd`).
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: CUdeviceptr,
    dst_ctx: Handle,
    src: CUdeviceptr,
    src_ctx: Handle,
    n: usize,
    s: Handle,
) -> CUresult {
    with(|w| {
        if !w.contexts.contains_key(&(dst_ctx as usize)) || !w.contexts.contains_key(&(src_ctx as usize)) {
            return INVALID_CONTEXT;
        }
        match w.stream(s) {
            Ok(id) => w.copy_dd(dst, src, n, id),
            Err(e) => e,
        }
    })
}

/// # Safety
/// `src` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    cuMemcpyHtoDAsync_v2(dst, src, n, std::ptr::null_mut())
}

/// # Safety
/// `dst` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    cuMemcpyDtoHAsync_v2(dst, src, n, std::ptr::null_mut())
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    cuMemcpyDtoDAsync_v2(dst, src, n, std::ptr::null_mut())
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(ptr: CUdeviceptr, value: u8, n: usize, s: Handle) -> CUresult {
    with(|w| w.memset(ptr, &[value], n, s))
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(ptr: CUdeviceptr, value: c_uint, n: usize, s: Handle) -> CUresult {
    // cuMemsetD32 needs a 4-byte aligned pointer (DRV, cuMemsetD32: "dstDevice ... must be four
    // byte aligned").
    if !ptr.is_multiple_of(4) {
        return INVALID_VALUE;
    }
    with(|w| w.memset(ptr, &value.to_le_bytes(), n, s))
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(ptr: CUdeviceptr, value: u8, n: usize) -> CUresult {
    cuMemsetD8Async(ptr, value, n, std::ptr::null_mut())
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(ptr: CUdeviceptr, value: c_uint, n: usize) -> CUresult {
    cuMemsetD32Async(ptr, value, n, std::ptr::null_mut())
}

// ---------------------------------------------------------------------------------------
// Modules and kernels. The fake compiles nothing: it parses the PTX (`ptx`), executes it with
// the PTX interpreter (`interp`) or, for a big launch, the kernel's Rust model (`kernels`).

/// Loads a PTX module (a NUL-terminated text) into the current context (DRV, cuModuleLoadData).
/// Text that is not PTX — no `.version` directive, or no `.entry` — is CUDA_ERROR_INVALID_PTX, as
/// the driver's JIT answers a module it cannot compile.
///
/// # Safety
/// `m` must be writable; `image` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut Handle, image: *const c_void) -> CUresult {
    if m.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    let text = CStr::from_ptr(image as *const c_char).to_string_lossy().into_owned();
    with(|w| {
        let ctx = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        if !text.lines().any(|l| l.trim_start().starts_with(".version")) || !text.contains(".entry") {
            eprintln!("fake-cuda: cuModuleLoadData: not a PTX module with an .entry");
            return INVALID_PTX;
        }
        // A driver loads PTX of the ISA versions its CUDA release knows, and answers newer text
        // with CUDA_ERROR_UNSUPPORTED_PTX_VERSION (DRV, cuModuleLoadData). Which CUDA release
        // first loads each ISA version: the PTX ISA's release history, as NVIDIA's cuda-python
        // maps it (`cuda.bindings.utils.get_minimal_required_cuda_ver_from_ptx_ver`).
        let needs =
            text.lines().find_map(|l| l.trim_start().strip_prefix(".version")).and_then(|v| ptx_min_driver(v.trim()));
        match needs {
            Some(min) if w.scenario.driver_version < min => {
                eprintln!(
                    "fake-cuda: cuModuleLoadData: PTX needs CUDA {}.{}, the driver is CUDA {}.{}",
                    min / 1000,
                    min % 1000 / 10,
                    w.scenario.driver_version / 1000,
                    w.scenario.driver_version % 1000 / 10
                );
                return codes::UNSUPPORTED_PTX_VERSION;
            }
            None => {
                eprintln!("fake-cuda: cuModuleLoadData: a .version this fake does not know");
                return INVALID_PTX;
            }
            Some(_) => {}
        }
        // The module is parsed now, as the driver JIT-compiles it now: text that is not PTX is
        // CUDA_ERROR_INVALID_PTX here, not at launch.
        let parsed = match ptx::parse(&text) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                eprintln!("fake-cuda: cuModuleLoadData: {e}");
                return INVALID_PTX;
            }
        };
        let h = w.handle();
        w.modules.insert(h, Module { ctx, ptx: parsed });
        *m = h as Handle;
        SUCCESS
    })
}

/// The first CUDA driver (as `cuDriverGetVersion` reports it) that loads PTX ISA `version`
/// (the PTX ISA's release history: 6.5 with CUDA 10.2, 7.x with 11.x, 8.0–8.5 with 12.0–12.5,
/// 8.6 with 12.7, 8.7 with 12.8, 8.8 with 12.9, 9.x with 13.x).
fn ptx_min_driver(version: &str) -> Option<i32> {
    let (major, minor) = version.split_once('.')?;
    let (major, minor): (i32, i32) = (major.parse().ok()?, minor.parse().ok()?);
    Some(match (major, minor) {
        (6, 5) => 10020,
        (7, m) if m <= 8 => 11000 + 10 * m,
        (8, m) if m <= 5 => 12000 + 10 * m,
        (8, 6) => 12070,
        (8, 7) => 12080,
        (8, 8) => 12090,
        (9, m) if m <= 9 => 13000 + 10 * m,
        _ => return None,
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: Handle) -> CUresult {
    with(|w| match w.modules.remove(&(m as usize)) {
        Some(_) => {
            w.functions.retain(|_, (module, _)| *module != m as usize);
            SUCCESS
        }
        None => INVALID_HANDLE,
    })
}

/// A kernel of a loaded module by name (DRV, cuModuleGetFunction): a name the module does not
/// declare is CUDA_ERROR_NOT_FOUND, an unknown module CUDA_ERROR_INVALID_HANDLE.
///
/// # Safety
/// `f` must be writable; `name` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut Handle, m: Handle, name: *const c_char) -> CUresult {
    if f.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let name = CStr::from_ptr(name).to_string_lossy().into_owned();
    with(|w| {
        let Some(module) = w.modules.get(&(m as usize)) else { return INVALID_HANDLE };
        if !module.ptx.functions.iter().any(|f| f.entry && f.name == name) {
            return NOT_FOUND;
        }
        let h = w.handle();
        w.functions.insert(h, (m as usize, name));
        *f = h as Handle;
        SUCCESS
    })
}

/// Launches a kernel on a stream of its module's context (DRV, cuLaunchKernel). A block of more
/// than 1024 threads is CUDA_ERROR_INVALID_VALUE (Hopper's limit, PG, "Compute Capabilities");
/// a stream of another context CUDA_ERROR_INVALID_HANDLE. The kernel's PTX runs through the
/// interpreter, or a big launch through its Rust model (`kernels::Path`); memory it may not
/// touch (freed, or a peer's without access) faults like a real kernel: the launch succeeds
/// and the context is poisoned with CUDA_ERROR_ILLEGAL_ADDRESS, seen by the next call.
///
/// # Safety
/// `params` must hold the kernel's arguments as the real launch takes them.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    _shared: c_uint,
    s: Handle,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    with(|w| {
        let Some((module, name)) = w.functions.get(&(f as usize)).cloned() else { return INVALID_HANDLE };
        let Some((mctx, code)) = w.modules.get(&module).map(|m| (m.ctx, m.ptx.clone())) else { return INVALID_HANDLE };
        let stream = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        if w.streams[&stream].ctx != mctx {
            eprintln!("fake-cuda: cuLaunchKernel: the stream belongs to another context than the kernel's module");
            return INVALID_HANDLE;
        }
        let threads = bx as u64 * by as u64 * bz as u64;
        if threads == 0 || threads > 1024 || gx == 0 || gy == 0 || gz == 0 {
            return INVALID_VALUE;
        }
        kernels::launch(w, &code, &name, mctx, stream, params, [gx, gy, gz], [bx, by, bz])
    })
}

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
        let a = self.allocs.get_mut(&base).expect("caller found the allocation");
        match &a.snapshot {
            Some((g, s)) if *g == a.generation => s.clone(),
            _ => {
                let mut bytes = vec![0u8; len];
                a.read_into(0, &mut bytes);
                let s = Arc::new(bytes);
                a.snapshot = Some((a.generation, s.clone()));
                s
            }
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ptx;
