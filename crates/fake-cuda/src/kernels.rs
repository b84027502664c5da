//! Launches: each runs its kernel's PTX through the interpreter (`interp`) or, when it is too
//! big to interpret, through the kernel's Rust model here, chosen by the name the module
//! declares: the agent's own (`src/probe/kernels.ptx`, whose comments state each contract) and
//! the fake's reference kernel, which its tests load. `tests_ptx` holds every model equal to
//! the PTX.
//!
//! Each model reads its arguments from the parameter buffer the `.entry`'s declarations lay
//! out (`cuLaunchKernel` passes one pointer per parameter, in order), checks that every
//! byte it touches is memory the launching context may reach — its GPU's, a peer's with access
//! enabled, or page-locked host memory through its unified address — and charges the time the
//! work takes on the GPU's SMs and HBM. A kernel touching memory it may not reach faults as a
//! real one does: the launch succeeds and the context is poisoned with
//! CUDA_ERROR_ILLEGAL_ADDRESS (700), which the next call returns.
//!
//! The memory-test kernels see the scenario's planted faults: stuck bits (a bit that always
//! reads one value) and coupled bits (a bit that reads another cell's bit). A pass finds a
//! fault only when its pattern gives the faulty bit a value it cannot hold, so solid patterns
//! miss a coupling between two cells they fill alike, and address patterns find it.

use super::*;

/// Words each thread of `phq_mem_check` takes per round of its grid-stride loop (kernels.ptx).
const ROUND_WORDS: u64 = 4;

/// The kernels reimplemented here, by the name their `.entry` declares.
pub(crate) const NAMES: &[&str] = &[
    "phq_fake_fill_u32",
    "phq_mem_write",
    "phq_mem_check",
    "phq_copy_sm",
    "phq_spin",
    "phq_chase",
    "phq_sgemm",
    "phq_dgemm",
    "phq_gemm_check",
    "phq_mma_gemm",
];

use crate::scenario::Path;

/// Thread-instructions a launch may take to be interpreted on the `auto` path: about a second
/// of the interpreter on one core (tens of millions of instructions a second).
pub const INTERPRET_BUDGET: u64 = 20_000_000;

/// What an interpreted launch may execute before it counts as hung (a loop that never ends).
const HANG_BUDGET: u64 = 2_000_000_000;

/// Runs kernel `name` of `module`, launched from context `ctx` on `stream` with a grid of
/// `grid` blocks of `block` threads.
///
/// # Safety
/// `params` holds one pointer per parameter of the kernel, each to a value of its type.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch(
    w: &mut World,
    module: &Arc<ptx::Module>,
    name: &str,
    ctx: usize,
    stream: usize,
    params: *mut *mut c_void,
    grid: [u32; 3],
    block: [u32; 3],
) -> CUresult {
    let Some(entry) = module.function(name) else { return NOT_FOUND };
    let f = &module.functions[entry];
    if params.is_null() && !f.params.is_empty() {
        return INVALID_VALUE;
    }
    // The parameter buffer as the kernel's `.param` declarations lay it out, each value copied
    // from its pointer (DRV, cuLaunchKernel: "kernelParams … an array of pointers to the
    // kernel's parameters").
    let size = f.params.last().map(|p| p.offset as usize + p.ty.bytes()).unwrap_or(0);
    let mut buf = vec![0u8; size];
    for (k, p) in f.params.iter().enumerate() {
        let src = *params.add(k) as *const u8;
        if src.is_null() {
            return INVALID_VALUE;
        }
        std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr().add(p.offset as usize), p.ty.bytes());
    }
    let a = Args { buf, offsets: f.params.iter().map(|p| p.offset as usize).collect() };
    let modelled = NAMES.contains(&name);
    let interpret = match w.scenario.kernels {
        Path::Interpret => true,
        Path::Model => !modelled,
        Path::Auto => !modelled || estimate(name, &a, grid, block).is_some_and(|n| n <= INTERPRET_BUDGET),
    };
    if interpret {
        return run_ptx(w, module, entry, ctx, stream, &a, grid, block);
    }
    model(w, name, ctx, stream, &a, grid, block)
}

/// Runs `name`'s Rust model.
pub(crate) fn model(
    w: &mut World,
    name: &str,
    ctx: usize,
    stream: usize,
    a: &Args,
    grid: [u32; 3],
    block: [u32; 3],
) -> CUresult {
    match name {
        "phq_fake_fill_u32" => fill_u32(w, ctx, stream, a),
        "phq_mem_write" => mem_write(w, ctx, stream, a),
        "phq_mem_check" => mem_check(w, ctx, stream, a, u64::from(grid[0]) * u64::from(block[0])),
        "phq_copy_sm" => copy_sm(w, ctx, stream, a),
        "phq_spin" => spin(w, ctx, a),
        "phq_chase" => chase(w, ctx, stream, a),
        "phq_sgemm" => sgemm(w, ctx, stream, a),
        "phq_dgemm" => dgemm(w, ctx, stream, a),
        "phq_gemm_check" => gemm_check(w, ctx, stream, a),
        "phq_mma_gemm" => mma_gemm(w, ctx, stream, a, grid, block),
        _ => {
            eprintln!("fake-cuda: cuLaunchKernel: no model of kernel {name:?}");
            NOT_SUPPORTED
        }
    }
}

/// About how many thread-instructions the PTX of a modelled kernel executes for these
/// arguments (its loop bodies counted from `kernels.ptx`); `None`: never interpreted on the
/// `auto` path (`phq_spin` waits for the host, which a synchronous interpreter cannot see).
pub(crate) fn estimate(name: &str, a: &Args, grid: [u32; 3], block: [u32; 3]) -> Option<u64> {
    let threads = u64::from(grid[0])
        * u64::from(grid[1])
        * u64::from(grid[2])
        * u64::from(block[0])
        * u64::from(block[1])
        * u64::from(block[2]);
    let per_thread = 30 * threads;
    Some(
        per_thread
            + match name {
                "phq_fake_fill_u32" => 10 * a.u64(2),
                "phq_mem_write" => 30 * a.u64(1),
                "phq_mem_check" => 70 * a.u64(1),
                "phq_copy_sm" => 10 * a.u64(2),
                "phq_chase" => 4 * a.u64(1),
                // The inner loop's 8 instructions per step of k, per entry, and the staging.
                "phq_sgemm" | "phq_dgemm" => {
                    let n = u64::from(a.u32(3));
                    9 * n.saturating_mul(n).saturating_mul(n)
                }
                "phq_gemm_check" => {
                    let n = u64::from(a.u32(1));
                    35 * n * n
                }
                // About 20 instructions a thread per step of 16 along k.
                "phq_mma_gemm" => 20 * threads * u64::from(a.u32(3) / 16),
                _ => return None,
            },
    )
}

/// Global memory as an interpreted kernel reaches it: its GPU's, a peer's with access from the
/// launching context, or page-locked host memory through its unified address — with the
/// scenario's stuck and coupled bits as the GPU's cells hold them.
pub(crate) struct DeviceMem<'a> {
    w: &'a mut World,
    ctx: usize,
    dev: usize,
    /// Seconds of dependent loads (`ld.cv`, volatile): each waits for its memory's latency.
    latency: f64,
    start_ns: u64,
    /// Every GPU's coupled cells as device addresses, (victim byte, bit, aggressor byte): read
    /// from the scenario once per launch, not at every load.
    couplings: Vec<(u64, u8, u64)>,
    /// Bytes of device memory the launch has loaded and stored so far.
    traffic: u64,
    /// What the launch touched in each allocation, entered in the L2 when it ends.
    touched: BTreeMap<u64, Touched>,
}

/// A launch's accesses to one allocation.
struct Touched {
    low: u64,
    high: u64,
    first_store: Option<u64>,
    last_store: u64,
    traffic: u64,
}

impl DeviceMem<'_> {
    fn note(&mut self, addr: u64, len: u64, store: bool) {
        self.traffic += len;
        let Some(base) = self.w.find_quiet(addr, len) else { return };
        let t = self.touched.entry(base).or_insert(Touched {
            low: addr,
            high: addr + len,
            first_store: None,
            last_store: addr,
            traffic: 0,
        });
        t.low = t.low.min(addr);
        t.high = t.high.max(addr + len);
        t.traffic += len;
        if store {
            t.first_store.get_or_insert(addr);
            t.last_store = addr;
        }
    }

    /// Enters what the launch touched in the L2s: each allocation's span as one extent, in the
    /// order its stores ran (the model kernels' extents, `mem_check`).
    fn enter_l2(self) {
        self.w.l2_since = 0;
        for t in self.touched.values() {
            let descending = t.first_store.is_some_and(|f| t.last_store < f);
            self.w.l2_touch(t.low, t.high - t.low, t.traffic, t.first_store.is_some(), descending);
        }
    }
}

impl DeviceMem<'_> {
    /// The device owning `[addr, addr + len)`, or why the kernel may not touch it.
    fn owner(&self, addr: u64, len: u64) -> Result<usize, String> {
        match self.w.find_quiet(addr, len) {
            Some(base) if self.w.reaches(self.ctx, base) => Ok(self.w.allocs[&base].device),
            Some(base) => Err(format!(
                "GPU {}'s memory, which this context has no peer access to",
                self.w.ordinal_of(self.w.allocs[&base].device)
            )),
            None if self.w.freed_at(addr) => Err("memory freed earlier (use after free)".into()),
            None => Err("no allocation holds it".into()),
        }
    }
}

impl interp::Memory for DeviceMem<'_> {
    fn load(&mut self, addr: u64, out: &mut [u8], uncached: bool) -> Result<(), String> {
        let len = out.len() as u64;
        if self.w.host_mapped(addr, len) {
            // SAFETY: host_mapped: [addr, addr + len) lies in a live page-locked allocation.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
            if uncached {
                self.latency += self.w.latency_s(self.dev, None);
            }
            return Ok(());
        }
        let owner = self.owner(addr, len)?;
        self.w.l2_since = self.traffic;
        self.w.read_into(addr, out).map_err(|e| format!("CUDA error {e}"))?;
        // A coupled bit reads its aggressor's bit as that cell holds it now, unless the victim's
        // line is dirty in the L2 (what was written, not the cell).
        for &(victim, bit, aggressor) in self.couplings.iter().filter(|c| c.0 >= addr && c.0 < addr + len) {
            if self.w.l2_line(victim) == l2::Line::Dirty {
                continue;
            }
            let mut aggr = [0u8; 1];
            if self.w.read_into(aggressor, &mut aggr).is_ok() {
                let (bit, byte) = (bit & 7, &mut out[(victim - addr) as usize]);
                *byte = (*byte & !(1 << bit)) | (((aggr[0] >> bit) & 1) << bit);
            }
        }
        if uncached {
            self.latency += self.w.device_latency_s(self.dev, owner, addr);
        } else {
            self.note(addr, len, false);
        }
        Ok(())
    }

    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), String> {
        let len = data.len() as u64;
        if self.w.host_mapped(addr, len) {
            // SAFETY: as in `load`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
            return Ok(());
        }
        self.owner(addr, len)?;
        self.note(addr, len, true);
        self.w.write(addr, data).map_err(|e| format!("CUDA error {e}"))
    }

    fn timer_start(&self) -> u64 {
        self.start_ns
    }
}

/// Global memory as a kernel launched from `ctx` on `stream` reaches it.
pub(crate) fn device_mem(w: &mut World, ctx: usize, stream: usize) -> DeviceMem<'_> {
    let dev = w.ctx_dev(ctx);
    let start_ns = GLOBALTIMER_EPOCH_NS + (w.stream_clock(stream) * 1e9) as u64;
    let couplings = (w.scenario.devices.iter().enumerate())
        .flat_map(|(d, spec)| {
            let base = BASE + d as u64 * SPAN;
            spec.coupled_bits.iter().map(move |c| (base + c.offset, c.bit, base + c.aggressor))
        })
        .collect();
    DeviceMem { w, ctx, dev, latency: 0.0, start_ns, couplings, traffic: 0, touched: BTreeMap::new() }
}

/// Runs entry `entry` through the interpreter, then charges the time the kernel's model would
/// (the same figures, so a probe's numbers do not depend on the path). A fault a real GPU
/// raises, or compute-sanitizer reports, poisons the context, as a faulting kernel does: the
/// launch succeeds and the next call returns the error (sticky).
#[allow(clippy::too_many_arguments)]
fn run_ptx(
    w: &mut World,
    module: &Arc<ptx::Module>,
    entry: usize,
    ctx: usize,
    stream: usize,
    a: &Args,
    grid: [u32; 3],
    block: [u32; 3],
) -> CUresult {
    let name = module.functions[entry].name.clone();
    let dev = w.ctx_dev(ctx);
    let gemm = matches!(name.as_str(), "phq_sgemm" | "phq_dgemm" | "phq_mma_gemm");
    if gemm {
        if let Err(code) = w.gemm_fault(dev) {
            return code;
        }
    }
    let mut mem = device_mem(w, ctx, stream);
    let limits = interp::Limits { max_instructions: HANG_BUDGET };
    let r = interp::run(module, entry, grid, block, &a.buf, &mut mem, &limits);
    let latency = mem.latency;
    mem.enter_l2();
    match r {
        Ok(stats) => {
            if gemm {
                plant_gemm_faults(w, ctx, a, if name == "phq_dgemm" { 8 } else { 4 });
            }
            // A kernel without a model is charged a thousand thread-instructions a nanosecond:
            // the fake's own round figure for a chip of 132 SMs issuing a few warp-instructions a
            // clock at about 1.8 GHz, not a measurement.
            let secs = model_secs(w, &name, dev, a).unwrap_or(stats.instructions as f64 / 1e12) + latency;
            w.run_on_sms(stream, secs);
            if gemm {
                crate::power::loaded(&w.spec(dev).pci_bus_id, secs, w.spec(dev).power_under_load_w);
            }
            SUCCESS
        }
        Err(f) => {
            eprintln!("fake-cuda: {f}");
            w.kernel_faults.push(f.clone());
            if f.code == interp::NOT_SUPPORTED {
                return NOT_SUPPORTED;
            }
            w.poison(dev, f.code);
            SUCCESS
        }
    }
}

/// A faulty GPU's GEMM: the scenario's wrong entries of C (FP32, or FP64 when `size` is 8)
/// come out 1.0 too large, whichever path computed the product.
fn plant_gemm_faults(w: &mut World, ctx: usize, a: &Args, size: usize) {
    let (pc, n) = (a.u64(2), a.u32(3) as usize);
    let dev = w.ctx_dev(ctx);
    for (i, j) in w.gemm_wrong(dev) {
        if i < n && j < n {
            let at = pc + (size * (i + j * n)) as u64;
            if let Ok(b) = w.read(at, size) {
                let v: Vec<u8> = if size == 8 {
                    let mut x = [0u8; 8];
                    x.copy_from_slice(&b[..8]);
                    (f64::from_le_bytes(x) + 1.0).to_le_bytes().to_vec()
                } else {
                    (f32::from_le_bytes([b[0], b[1], b[2], b[3]]) + 1.0).to_le_bytes().to_vec()
                };
                let _ = w.write(at, &v);
            }
        }
    }
}

/// The seconds a modelled kernel's launch takes (what its model charges).
fn model_secs(w: &World, name: &str, dev: usize, a: &Args) -> Option<f64> {
    let hbm = w.hbm_gbps(dev) * 1e9;
    Some(match name {
        "phq_fake_fill_u32" => a.u64(2) as f64 * 4.0 / hbm,
        "phq_mem_write" => a.u64(1) as f64 * 8.0 / hbm,
        "phq_mem_check" => a.u64(1) as f64 * 8.0 * if a.u32(4) != u32::MAX { 2.0 } else { 1.0 } / hbm,
        "phq_copy_sm" => 2.0 * a.u64(2) as f64 * 16.0 / (w.sm_copy_gbps(dev) * 1e9),
        "phq_chase" | "phq_spin" => 0.0,
        "phq_sgemm" => {
            let n = f64::from(a.u32(3));
            let spec = w.spec(dev);
            2.0 * n * n * n
                / (spec.ptx_sgemm_tflops.unwrap_or(spec.sgemm_tflops * crate::scenario::PTX_SGEMM_SHARE) * 1e12)
        }
        "phq_dgemm" => {
            let n = f64::from(a.u32(3));
            2.0 * n * n * n / (w.spec(dev).ptx_dgemm_tflops() * 1e12)
        }
        "phq_gemm_check" => {
            let n = a.u32(1) as f64;
            n * n * 4.0 / hbm
        }
        "phq_mma_gemm" => {
            let n = f64::from(a.u32(3));
            2.0 * n * n * n / (w.spec(dev).mma_tflops * 1e12)
        }
        _ => return None,
    })
}

/// The kernel's parameter buffer, as its `.param` declarations lay it out, and each
/// parameter's offset in it: the models read their arguments by position.
pub(crate) struct Args {
    pub(crate) buf: Vec<u8>,
    pub(crate) offsets: Vec<usize>,
}

impl Args {
    fn bytes<const N: usize>(&self, i: usize) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some(src) = self.offsets.get(i).and_then(|o| self.buf.get(*o..*o + N)) {
            out.copy_from_slice(src);
        }
        out
    }
    pub(crate) fn u64(&self, i: usize) -> u64 {
        u64::from_le_bytes(self.bytes(i))
    }
    pub(crate) fn u32(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.bytes(i))
    }
}

/// What `%globaltimer` reads when the fake's clock starts: a GPU's timer is an absolute count of
/// nanoseconds (PTX ISA, "Special Registers: %globaltimer": a 64-bit global nanosecond timer),
/// shared by every kernel, not a count from the launch or from zero. Fixed here for repeatable
/// runs, about 1.8e18 (the order of Unix time in nanoseconds), at a value whose low 32 bits wrap
/// 65 µs after the start: a kernel that kept the timer or its deadline in 32 bits would see time
/// run backwards in the first spin it makes, as it could on a GPU at any moment.
pub(crate) const GLOBALTIMER_EPOCH_NS: u64 = 0x1900_0000_FFFF_0000;

/// The 64-bit word the memory-test patterns put at byte address `a` (kernels.ptx, the pattern
/// both memory-test kernels compute inline):
/// mode 1 the address, 2 its inverse, 3 a xorshift64 step of the word index times the
/// golden-ratio constant XOR the seed, anything else the constant `arg`.
pub(crate) fn pattern(a: u64, mode: u32, arg: u64) -> u64 {
    match mode {
        1 => a,
        2 => !a,
        3 => {
            let mut x = (a >> 3).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ arg;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
        _ => arg,
    }
}

/// A pattern as a function of the address (two specs with the same key hold the same words).
fn key(mode: u32, arg: u64) -> (u32, u64) {
    match mode {
        1 | 2 => (mode, 0),
        3 => (3, arg),
        _ => (0, arg),
    }
}

/// Whether `[ptr, ptr + len)` is device memory context `ctx` may touch, or poisons its GPU as a
/// real kernel's stray access does. Returns the allocation's base.
fn reach(w: &mut World, ctx: usize, what: &str, ptr: u64, len: u64) -> Option<u64> {
    match w.find(ptr, len) {
        Ok((base, _)) if w.reaches_ptr(ctx, ptr, len) == Ok(true) => Some(base),
        _ => {
            eprintln!("fake-cuda: {what}: [{ptr:#x}, +{len}) is not memory this GPU may access");
            let dev = w.ctx_dev(ctx);
            w.poison(dev, ILLEGAL_ADDRESS);
            None
        }
    }
}

/// Writes pattern `(mode, arg)` over `[ptr, ptr + len)`: the whole allocation as a pattern, a
/// part of it as bytes.
fn write_pattern(w: &mut World, base: u64, ptr: u64, len: usize, mode: u32, arg: u64) -> Result<(), CUresult> {
    let whole = ptr == base && len == w.allocs[&base].len;
    if whole {
        blas::overwrite(w, base, 0, len);
        let a = w.allocs.get_mut(&base).ok_or(INVALID_VALUE)?;
        a.mem = Mem::Pattern { mode, arg };
        a.generation += 1;
        return Ok(());
    }
    w.write_with(ptr, len, |dst, at| pattern_bytes(dst, ptr + at as u64, mode, arg))
}

/// `phq_mem_write(u64 ptr, u64 words, u32 mode, u64 arg)`.
fn mem_write(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (ptr, words, mode, arg) = (a.u64(0), a.u64(1), a.u32(2), a.u64(3));
    let len = words * 8;
    let Some(base) = reach(w, ctx, "phq_mem_write", ptr, len) else { return SUCCESS };
    if let Err(e) = write_pattern(w, base, ptr, len as usize, mode, arg) {
        return e;
    }
    w.l2_touch(ptr, len, len, true, false);
    let dev = w.ctx_dev(ctx);
    let secs = len as f64 / (w.hbm_gbps(dev) * 1e9);
    w.run_on_sms(stream, secs);
    SUCCESS
}

/// The word at `addr` as memory holds it now (stuck bits included), if it is allocated.
fn stored(w: &mut World, addr: u64) -> Option<u64> {
    let b = w.read(addr, 8).ok()?;
    Some(u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
}

/// `phq_mem_check(u64 ptr, u64 words, u32 mode, u64 arg, u32 next_mode, u64 next_arg,
/// u32 descending, u64 result)`.
fn mem_check(w: &mut World, ctx: usize, stream: usize, a: &Args, stride: u64) -> CUresult {
    let (ptr, words, mode, arg) = (a.u64(0), a.u64(1), a.u32(2), a.u64(3));
    let (next_mode, next_arg, descending, result) = (a.u32(4), a.u64(5), a.u32(6) != 0, a.u64(7));
    let len = words * 8;
    let Some(base) = reach(w, ctx, "phq_mem_check", ptr, len) else { return SUCCESS };
    if reach(w, ctx, "phq_mem_check (result)", result, 200).is_none() {
        return SUCCESS;
    }
    blas::materialise(w, base, (ptr - base) as usize, len as usize);
    let dev = w.ctx_dev(ctx);
    let dev_base = BASE + dev as u64 * SPAN;
    let end = ptr + len;
    let rewrites = next_mode != u32::MAX;
    // The word a pass finds at `addr`: what memory holds, with a coupled bit reading its
    // aggressor's bit as it is when the kernel loads `addr` — already rewritten with the next
    // pattern if the kernel rewrote the aggressor first. Every thread of the grid takes four
    // words per round of its grid-stride loop (kernels.ptx: i, i + S, i + 2S, i + 3S, so a
    // round covers 4S consecutive words, S the grid's threads) and issues their loads before
    // any store: the aggressor is rewritten first only when it lies in an earlier round's words
    // (`round`), not merely at a lower address (the interpreter's order, `interp`).
    let couplings = w.scenario.devices[dev].coupled_bits.clone();
    let round = |addr: u64| {
        let j = (addr - ptr) / 8;
        (if descending { words - 1 - j } else { j }) / (ROUND_WORDS * stride).max(1)
    };
    // The launch's own traffic before it reaches `addr` in its walking order (the L2 counts it).
    let factor = if rewrites { 2 } else { 1 };
    let since = |addr: u64| factor * if descending { end - 8 - addr } else { addr - ptr };
    let seen = |w: &mut World, addr: u64, held: u64| -> u64 {
        let mut v = held;
        for c in couplings.iter().filter(|c| dev_base + (c.offset & !7) == addr) {
            if w.l2_line(dev_base + c.offset) == l2::Line::Dirty {
                continue;
            }
            let aggr = dev_base + (c.aggressor & !7);
            let first = aggr >= ptr && aggr < end && round(aggr) < round(addr);
            let av = if rewrites && aggr >= ptr && aggr < end && first {
                Some(pattern(aggr, next_mode, next_arg))
            } else {
                stored(w, aggr)
            };
            let Some(av) = av else { continue };
            let from = (c.aggressor & 7) * 8 + u64::from(c.bit & 7);
            let to = (c.offset & 7) * 8 + u64::from(c.bit & 7);
            v = (v & !(1 << to)) | (((av >> from) & 1) << to);
        }
        v
    };
    let held_as = match w.allocs[&base].mem {
        Mem::Fill(x) => Some(key(0, u64::from(x) | u64::from(x) << 32)),
        Mem::Pattern { mode, arg } => Some(key(mode, arg)),
        Mem::Pages { .. } => None,
    };
    let mut bad: Vec<(u64, u64, u64)> = Vec::new();
    if held_as == Some(key(mode, arg)) {
        // Memory holds the expected pattern: only the planted faults can differ.
        let spec = &w.scenario.devices[dev];
        let mut sites: Vec<u64> = spec
            .stuck_bits
            .iter()
            .map(|b| b.offset)
            .chain(spec.coupled_bits.iter().map(|c| c.offset))
            .map(|o| dev_base + (o & !7))
            .filter(|x| *x >= ptr && *x < end)
            .collect();
        sites.sort_unstable();
        sites.dedup();
        if descending {
            sites.reverse();
        }
        for addr in sites {
            w.l2_since = since(addr);
            let Some(held) = stored(w, addr) else { continue };
            let got = seen(w, addr, held);
            let want = pattern(addr, mode, arg);
            if got != want {
                bad.push((addr, got, want));
            }
        }
    } else {
        // Every word compared, a chunk at a time, in the pass's order.
        const CHUNK: u64 = 1 << 20;
        let mut starts: Vec<u64> = (0..len.div_ceil(CHUNK)).map(|i| ptr + i * CHUNK).collect();
        if descending {
            starts.reverse();
        }
        for s in starts {
            let n = CHUNK.min(end - s);
            w.l2_since = since(if descending { s + n - 8 } else { s });
            let Ok(bytes) = w.read(s, n as usize) else { return INVALID_VALUE };
            let mut found: Vec<(u64, u64, u64)> = Vec::new();
            for (i, c) in bytes.chunks_exact(8).enumerate() {
                let addr = s + 8 * i as u64;
                let held = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                let got = seen(w, addr, held);
                let want = pattern(addr, mode, arg);
                if got != want {
                    found.push((addr, got, want));
                }
            }
            if descending {
                found.reverse();
            }
            bad.extend(found);
        }
    }
    w.l2_since = 0;
    if let Err(e) = record(w, result, bad.len() as u64, &bad) {
        return e;
    }
    w.l2_touch(ptr, len, len * factor, rewrites, descending);
    if rewrites {
        if let Err(e) = write_pattern(w, base, ptr, len as usize, next_mode, next_arg) {
            return e;
        }
    }
    let traffic = len as f64 * if rewrites { 2.0 } else { 1.0 };
    let secs = traffic / (w.hbm_gbps(dev) * 1e9);
    w.run_on_sms(stream, secs);
    SUCCESS
}

/// What the check kernels leave in their result buffer: `count` added to the 64-bit count at
/// `result` (atomically, on a GPU), and the first eight of all the launches' mismatches as
/// (address or element, read, expected) at `result + 8 + 24·slot`.
fn record(w: &mut World, result: u64, count: u64, bad: &[(u64, u64, u64)]) -> Result<(), CUresult> {
    let old = stored(w, result).ok_or(INVALID_VALUE)?;
    w.write(result, &(old + count).to_le_bytes())?;
    for (slot, (at, got, want)) in (old..8).zip(bad) {
        let rec: Vec<u8> = [*at, *got, *want].iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write(result + 8 + 24 * slot, &rec)?;
    }
    Ok(())
}

/// `phq_copy_sm(u64 dst, u64 src, u64 count)`: count 16-byte vectors; reads and writes every
/// byte, at the GPU's SM copy rate.
fn copy_sm(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (dst, src, count) = (a.u64(0), a.u64(1), a.u64(2));
    let len = count * 16;
    if dst % 16 != 0 || src % 16 != 0 {
        // A misaligned vector access is a misaligned-address fault (PTX ISA, "Vectors": vector
        // accesses must be aligned to their size): sticky 716.
        eprintln!("fake-cuda: phq_copy_sm: {dst:#x} or {src:#x} is not 16-byte aligned");
        let dev = w.ctx_dev(ctx);
        w.poison(dev, 716);
        return SUCCESS;
    }
    if reach(w, ctx, "phq_copy_sm (source)", src, len).is_none()
        || reach(w, ctx, "phq_copy_sm (destination)", dst, len).is_none()
    {
        return SUCCESS;
    }
    if let Err(e) = w.copy(dst, src, len as usize) {
        return e;
    }
    w.l2_touch(src, len, len, false, false);
    w.l2_touch(dst, len, len, true, false);
    let dev = w.ctx_dev(ctx);
    let secs = 2.0 * len as f64 / (w.sm_copy_gbps(dev) * 1e9);
    w.run_on_sms(stream, secs);
    SUCCESS
}

/// A spin kernel holding its stream until the host writes its flag.
pub(crate) struct Gate {
    flag: u64,
    status: u64,
    timeout_ns: u64,
}

/// `phq_spin(u64 flag, u64 timeout_ns, u64 status)`: flag and status must be page-locked host
/// memory (reached through its unified address). A flag already set lets the stream go at once.
/// Otherwise the kernel waits for the host: the fake does not model launch gaps, so the copies
/// queued behind it run as if the host released it at once — but a stream waited on while the
/// flag is still clear would, on a GPU, have waited for the timeout, so the fake then writes
/// the kernel's timed-out status (`settle_gates`).
fn spin(w: &mut World, ctx: usize, a: &Args) -> CUresult {
    let (flag, timeout_ns, status) = (a.u64(0), a.u64(1), a.u64(2));
    if !w.host_mapped(flag, 4) || !w.host_mapped(status, 4) {
        eprintln!("fake-cuda: phq_spin: the flag {flag:#x} or status {status:#x} is not page-locked host memory");
        let dev = w.ctx_dev(ctx);
        w.poison(dev, ILLEGAL_ADDRESS);
        return SUCCESS;
    }
    // SAFETY: host_mapped: the flag lies in a live page-locked allocation.
    if unsafe { std::ptr::read_volatile(flag as *const u32) } == 0 {
        w.gates.push(Gate { flag, status, timeout_ns });
    }
    SUCCESS
}

/// At a synchronization: every spin kernel whose flag is still clear timed out.
pub(crate) fn settle_gates(w: &mut World) {
    for g in std::mem::take(&mut w.gates) {
        // SAFETY: `spin` checked both words lie in live page-locked allocations; the host may
        // free them only after synchronizing, which is now.
        unsafe {
            if std::ptr::read_volatile(g.flag as *const u32) == 0 {
                eprintln!(
                    "fake-cuda: phq_spin: its stream was waited on before the host released the flag: it timed out after {} ns",
                    g.timeout_ns
                );
                std::ptr::write_volatile(g.status as *mut u32, 1);
            }
        }
    }
}

/// `phq_chase(u64 start, u64 steps, u64 out)`: follows 64-bit pointers through host, local or
/// peer memory; each step costs that memory's latency (the scenario's).
fn chase(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (mut p, steps, out) = (a.u64(0), a.u64(1), a.u64(2));
    let dev = w.ctx_dev(ctx);
    let mut secs = 0.0;
    for _ in 0..steps {
        if w.host_mapped(p, 8) && p % 8 == 0 {
            // SAFETY: host_mapped: [p, p + 8) lies in a live page-locked allocation.
            p = unsafe { std::ptr::read_volatile(p as *const u64) };
            secs += w.latency_s(dev, None);
        } else {
            let Some(base) = reach(w, ctx, "phq_chase", p, 8) else { return SUCCESS };
            let owner = w.allocs[&base].device;
            let Some(next) = stored(w, p) else { return INVALID_VALUE };
            secs += w.device_latency_s(dev, owner, p);
            p = next;
        }
    }
    if w.host_mapped(out, 8) {
        // SAFETY: host_mapped: [out, out + 8) lies in a live page-locked allocation.
        unsafe { std::ptr::write_volatile(out as *mut u64, p) };
    } else if reach(w, ctx, "phq_chase (out)", out, 8).is_some() {
        if let Err(e) = w.write(out, &p.to_le_bytes()) {
            return e;
        }
    } else {
        return SUCCESS;
    }
    w.run_on_sms(stream, secs);
    SUCCESS
}

/// `phq_sgemm(u64 a, u64 b, u64 c, u32 n)`: C = A·B, n×n column-major, n a multiple of 16 (the
/// kernel's tiles; another n would read past the matrices: an illegal address). The product is
/// the same lazy one cuBLAS's SGEMM leaves, at the scenario's PTX GEMM rate.
fn sgemm(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (pa, pb, pc, n) = (a.u64(0), a.u64(1), a.u64(2), a.u32(3) as usize);
    let dev = w.ctx_dev(ctx);
    if !tiles_fit(w, dev, "phq_sgemm", n) {
        return SUCCESS;
    }
    let spec = w.spec(dev);
    let tflops = spec.ptx_sgemm_tflops.unwrap_or(spec.sgemm_tflops * crate::scenario::PTX_SGEMM_SHARE);
    lazy_product(w, ctx, stream, blas::Inputs::F32, (pa, pb, pc, n), tflops)
}

/// `phq_dgemm(u64 a, u64 b, u64 c, u32 n)`: `phq_sgemm` in FP64 (its tiles, its launch), each
/// entry summed in k order by `fma.rn.f64`: the lazy FP64 product cuBLAS's DGEMM leaves, at the
/// scenario's PTX DGEMM rate.
fn dgemm(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (pa, pb, pc, n) = (a.u64(0), a.u64(1), a.u64(2), a.u32(3) as usize);
    let dev = w.ctx_dev(ctx);
    if !tiles_fit(w, dev, "phq_dgemm", n) {
        return SUCCESS;
    }
    let tflops = w.spec(dev).ptx_dgemm_tflops();
    lazy_product(w, ctx, stream, blas::Inputs::F64, (pa, pb, pc, n), tflops)
}

/// Whether the agent's 16-wide GEMM tiles fit an n×n matrix; if not, the kernel's tiles run
/// past the matrices and GPU `dev` is poisoned with an illegal address, as a GPU's would be.
fn tiles_fit(w: &mut World, dev: usize, kernel: &str, n: usize) -> bool {
    if n != 0 && n.is_multiple_of(16) {
        return true;
    }
    eprintln!("fake-cuda: {kernel}: n = {n} is not a multiple of 16: the tiles run past the matrices");
    w.poison(dev, ILLEGAL_ADDRESS);
    false
}

/// A GEMM kernel's product as the lazy one the FP32 GEMMs leave (`blas::queue`), at `tflops`.
fn lazy_product(
    w: &mut World,
    ctx: usize,
    stream: usize,
    inputs: blas::Inputs,
    (pa, pb, pc, n): (u64, u64, u64, usize),
    tflops: f64,
) -> CUresult {
    match blas::queue(w, ctx, stream, inputs, (n, n, n), 1.0, (pa, n), (pb, n), 0.0, (pc, n), tflops) {
        blas::Queued::Done | blas::Queued::Poisoned => SUCCESS,
        blas::Queued::Failed => 719, // CUDA_ERROR_LAUNCH_FAILED
    }
}

/// `phq_mma_gemm(u64 a, u64 b, u64 c, u32 n, u32 f16)` (tensor.ptx): C = A·B with A row-major, B
/// column-major, both BF16 (f16 = 0) or FP16, C column-major FP32, n a multiple of 16. Warp v
/// of block b (32 threads each, the kernel counts four to a block) computes tile 4b + v of the (n/16)·(n/8) tiles,
/// numbered down the columns, if there is one; each entry is the sum in k order in FP32, as
/// the interpreter's `mma.sync` adds (the ISA leaves a tensor core's order open; the agent's
/// inputs are exact in any order).
fn mma_gemm(w: &mut World, ctx: usize, stream: usize, a: &Args, grid: [u32; 3], block: [u32; 3]) -> CUresult {
    let (pa, pb, pc, n) = (a.u64(0), a.u64(1), a.u64(2), a.u32(3) as usize);
    let (inputs, half) = match a.u32(4) {
        0 => (blas::Inputs::Bf16RowCol, ptx::Half::Bf16),
        _ => (blas::Inputs::F16RowCol, ptx::Half::F16),
    };
    let dev = w.ctx_dev(ctx);
    if !tiles_fit(w, dev, "phq_mma_gemm", n) {
        return SUCCESS;
    }
    let threads = block[0] * block[1] * block[2];
    if !threads.is_multiple_of(32) {
        // mma.sync.aligned needs every thread of a full warp (PTX ISA, "mma").
        eprintln!("fake-cuda: phq_mma_gemm: a block of {threads} threads leaves a partial warp at mma.sync");
        w.poison(dev, interp::ILLEGAL_INSTRUCTION);
        return SUCCESS;
    }
    let (nn, bytes) = ((n * n) as u64, 2u64);
    if reach(w, ctx, "phq_mma_gemm (A)", pa, nn * bytes).is_none()
        || reach(w, ctx, "phq_mma_gemm (B)", pb, nn * bytes).is_none()
        || reach(w, ctx, "phq_mma_gemm (C)", pc, nn * 4).is_none()
    {
        return SUCCESS;
    }
    let (rows, tiles) = (n / 16, (n / 16) * (n / 8));
    let blocks = (grid[0] * grid[1] * grid[2]) as usize;
    let warps = (threads / 32) as usize;
    let covers = |t: usize| (0..blocks).any(|b| t >= 4 * b && t < 4 * b + warps);
    if (0..tiles).all(covers) {
        // Every tile has a warp: the lazy product (`blas`), as the FP32 GEMMs leave it, with the
        // scenario's GEMM faults.
        let tflops = w.spec(dev).mma_tflops;
        return lazy_product(w, ctx, stream, inputs, (pa, pb, pc, n), tflops);
    }
    // A grid short of the tiles: only those with a warp are written.
    let (Ok(am), Ok(bm)) = (w.read(pa, n * n * 2), w.read(pb, n * n * 2)) else { return INVALID_VALUE };
    let elem = |m: &[u8], i: usize| half.to_f32(u16::from_le_bytes([m[2 * i], m[2 * i + 1]]));
    let mut done = vec![false; tiles];
    for b in 0..blocks {
        for v in 0..warps {
            let tile = 4 * b + v;
            if tile >= tiles || done[tile] {
                continue;
            }
            done[tile] = true;
            let (row0, col0) = (16 * (tile % rows), 8 * (tile / rows));
            let mut out = vec![0u8; 16 * 4];
            for col in col0..col0 + 8 {
                for (r, cell) in out.chunks_exact_mut(4).enumerate() {
                    let row = row0 + r;
                    let mut acc = 0f32;
                    for k in 0..n {
                        acc += elem(&am, row * n + k) * elem(&bm, col * n + k);
                    }
                    cell.copy_from_slice(&acc.to_le_bytes());
                }
                if let Err(e) = w.write(pc + 4 * (col * n + row0) as u64, &out) {
                    return e;
                }
            }
        }
    }
    let secs = 2.0 * (n as f64).powi(3) / (w.spec(dev).mma_tflops * 1e12);
    w.run_on_sms(stream, secs);
    SUCCESS
}

/// `phq_gemm_check(u64 c, u32 n, u64 table, u64 result)`: every entry of C compared bit for bit
/// with `table[(i mod 17)·17 + (j mod 17)]`; the count and first eight (element index, read,
/// expected) in `result`, as `phq_mem_check` leaves them.
fn gemm_check(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (pc, n, table, result) = (a.u64(0), a.u32(1) as u64, a.u64(2), a.u64(3));
    let len = n * n * 4;
    let Some(base) = reach(w, ctx, "phq_gemm_check", pc, len) else { return SUCCESS };
    if reach(w, ctx, "phq_gemm_check (table)", table, 17 * 17 * 4).is_none()
        || reach(w, ctx, "phq_gemm_check (result)", result, 200).is_none()
    {
        return SUCCESS;
    }
    let Ok(t) = w.read(table, 17 * 17 * 4) else { return INVALID_VALUE };
    let want = |i: u64, j: u64| {
        let at = (4 * ((i % 17) * 17 + (j % 17))) as usize;
        u32::from_le_bytes([t[at], t[at + 1], t[at + 2], t[at + 3]])
    };
    let mut bad: Vec<(u64, u64, u64)> = Vec::new();
    let mut count = 0u64;
    let whole = pc == base && len as usize == w.allocs[&base].len;
    match whole.then(|| blas::periodic_table(w, base, 17)).flatten() {
        Some(got) => {
            // C repeats with period 17 but for the scenario's wrong entries: compare the table,
            // count each wrong residue pair's entries, add the exceptions, list the first ones by
            // element index.
            let per = |r: u64| (n - r).div_ceil(17);
            let wrong: Vec<(usize, usize)> =
                w.allocs[&base].pending.as_ref().map(|p| p.wrong_entries().to_vec()).unwrap_or_default();
            for (i, j) in wrong.into_iter().map(|(i, j)| (i as u64, j as u64)).filter(|(i, j)| *i < n && *j < n) {
                let sum = got[((i % 17) * 17 + j % 17) as usize];
                // An entry of a residue pair that is wrong anyway is counted below already.
                if sum.to_bits() != want(i, j) {
                    continue;
                }
                let v = sum + 1.0;
                if v.to_bits() != want(i, j) {
                    count += 1;
                    bad.push((i + j * n, u64::from(v.to_bits()), u64::from(want(i, j))));
                }
            }
            for e in 0..17 * 17u64 {
                let (p, q) = (e / 17, e % 17);
                let g = got[e as usize].to_bits();
                if g != want(p, q) {
                    count += per(p) * per(q);
                    for j in (q..n).step_by(17).take(8) {
                        for i in (p..n).step_by(17).take(8) {
                            bad.push((i + j * n, u64::from(g), u64::from(want(p, q))));
                        }
                    }
                }
            }
            bad.sort_unstable();
        }
        None => {
            let Ok(bytes) = w.read(pc, len as usize) else { return INVALID_VALUE };
            for (e, c) in bytes.chunks_exact(4).enumerate() {
                let e = e as u64;
                let g = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                if g != want(e % n, e / n) {
                    count += 1;
                    if bad.len() < 8 {
                        bad.push((e, u64::from(g), u64::from(want(e % n, e / n))));
                    }
                }
            }
        }
    }
    if let Err(e) = record(w, result, count, &bad) {
        return e;
    }
    let dev = w.ctx_dev(ctx);
    let secs = len as f64 / (w.hbm_gbps(dev) * 1e9);
    w.run_on_sms(stream, secs);
    SUCCESS
}

/// `phq_fake_fill_u32(u64 dst, u32 value, u64 count)`: `count` 32-bit words at `dst` set to
/// `value`, one write per byte of HBM traffic. The fake's reference kernel.
fn fill_u32(w: &mut World, ctx: usize, stream: usize, a: &Args) -> CUresult {
    let (dst, value, count) = (a.u64(0), a.u32(1), a.u64(2));
    let len = count * 4;
    if reach(w, ctx, "phq_fake_fill_u32", dst, len).is_none() {
        return SUCCESS;
    }
    if let Err(e) = w.fill(dst, len as usize, value) {
        return e;
    }
    w.l2_touch(dst, len, len, true, false);
    let dev = w.ctx_dev(ctx);
    let secs = len as f64 / (w.hbm_gbps(dev) * 1e9);
    w.run_on_sms(stream, secs);
    SUCCESS
}
