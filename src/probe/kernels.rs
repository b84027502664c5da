//! The probes that run the agent's own kernels (`kernels.ptx`, embedded and JIT-compiled by the
//! driver): the memory test, the SM copy, the spin gate that times copies as nvbandwidth does,
//! and the pointer chase that measures latency.

use super::{MemtestPass, MemtestResult};
use crate::cuda::{self, Arg, Ctx, DeviceBuffer, Function, Module, PinnedBuffer, Stream};
use std::sync::Arc;

/// The kernels' text, assembled by CI with ptxas (tests/ptx.rs).
pub(crate) const PTX: &str = include_str!("kernels.ptx");
/// The tensor-core kernel, a module of its own: it needs sm_80 or later.
pub(crate) const TENSOR_PTX: &str = include_str!("tensor.ptx");

/// Threads per block of the grid-stride kernels; 8 blocks per SM fill Hopper's 2,048 threads
/// per SM (CUDA programming guide, "Compute Capabilities", 9.0).
pub(crate) const BLOCK: u32 = 256;
pub(crate) const BLOCKS_PER_SM: u32 = 8;

/// How long a spin kernel holds its stream at most: nvbandwidth's `DEFAULT_SPIN_KERNEL_TIMEOUT`
/// (10 s, its kernels.cuh).
const SPIN_TIMEOUT_NS: u64 = 10_000_000_000;

/// A GPU's loaded kernels.
pub(crate) struct Loaded {
    pub module: Module,
    /// Blocks for a grid-stride launch that fills the GPU.
    pub grid: u32,
    /// The GPU's L2 in bytes (`CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE`), which the memory test
    /// evicts between passes and the peer chase before each sample.
    pub l2_bytes: usize,
    /// The tensor-core module, or why the driver would not load it (a GPU before sm_80).
    pub tensor: Result<Module, String>,
}

impl Loaded {
    pub fn load(ctx: &Arc<Ctx>, sms: u32, l2_bytes: usize) -> cuda::Result<Loaded> {
        let module = ctx.load_ptx(PTX)?;
        let tensor = match ctx.load_ptx(TENSOR_PTX) {
            Ok(m) => Ok(m),
            Err(e) if e.sticky => return Err(e),
            Err(e) => Err(format!("the driver could not load the tensor-core kernel (it needs sm_80 or later): {e}")),
        };
        Ok(Loaded { module, grid: sms.max(1) * BLOCKS_PER_SM, l2_bytes, tensor })
    }
}

/// The memory test's patterns (kernels.ptx, computed inline by both memory-test kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pattern {
    pub mode: u32,
    pub arg: u64,
}

impl Pattern {
    pub const fn solid(word: u64) -> Pattern {
        Pattern { mode: 0, arg: word }
    }
    pub const ADDRESS: Pattern = Pattern { mode: 1, arg: 0 };
    pub const NOT_ADDRESS: Pattern = Pattern { mode: 2, arg: 0 };
    pub const fn random(seed: u64) -> Pattern {
        Pattern { mode: 3, arg: seed }
    }
}

/// One step of the memory test.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// Every word written with the pattern.
    Write(Pattern),
    /// Every word checked against `want`, then (a moving-inversions pass) written with `then`;
    /// walking down from the top when `descending`.
    Check { name: String, want: Pattern, then: Option<Pattern>, descending: bool },
    /// Memory left alone with its pattern (bit fade: a cell that leaks loses its charge).
    Pause(std::time::Duration),
}

fn check(name: impl Into<String>, want: Pattern, then: Option<Pattern>, descending: bool) -> Step {
    Step::Check { name: name.into(), want, then, descending }
}

/// The memory test of a level. Every level covers the same memory (90% of what is free); the
/// levels differ in patterns.
///
/// - quick: address in address (each word holds its own address: a fault in the address
///   decoding makes two addresses one cell and one of them reads the other's address), its
///   inverse (every bit the other value), and a seeded random pattern (neighbouring cells get
///   unrelated values, for coupling between cells);
/// - standard: also moving inversions (memtest86's test 3/4 scheme: fill p; up: check p, write
///   NOT p; down: check NOT p, write p; check p) with 0x00… and 0x55…, which find stuck bits
///   both ways and cells disturbed by writes to their neighbours, in both address directions;
/// - full: also a second random seed and bit fade (all ones, then all zeros, left for
///   `fade` before they are checked: cells that leak charge lose it).
pub(crate) fn steps(level: crate::config::ProbeLevel, seed: u64, fade: std::time::Duration) -> Vec<Step> {
    use crate::config::ProbeLevel;
    // Each pattern written whole, then checked whole: a check that rewrote as it went would
    // compare a cell with neighbours already holding the next pattern, and miss a coupling
    // between two of them (the fake's coupled-bit test found this). The traffic is the same.
    let mut s = vec![
        Step::Write(Pattern::ADDRESS),
        check("address in address", Pattern::ADDRESS, None, false),
        Step::Write(Pattern::NOT_ADDRESS),
        check("inverse address", Pattern::NOT_ADDRESS, None, false),
        Step::Write(Pattern::random(seed)),
        check(format!("random (seed {seed:#018x})"), Pattern::random(seed), None, false),
    ];
    if matches!(level, ProbeLevel::Standard | ProbeLevel::Full) {
        for p in [0u64, 0x5555_5555_5555_5555] {
            let (a, b) = (Pattern::solid(p), Pattern::solid(!p));
            s.push(Step::Write(a));
            s.push(check(format!("moving inversions up {p:#018x}"), a, Some(b), false));
            s.push(check(format!("moving inversions down {:#018x}", !p), b, Some(a), true));
            s.push(check(format!("solid {p:#018x}"), a, None, false));
        }
    }
    if level == ProbeLevel::Full {
        let seed2 = seed.rotate_left(32) ^ 0x9E37_79B9_7F4A_7C15;
        s.push(Step::Write(Pattern::random(seed2)));
        s.push(check(format!("random (seed {seed2:#018x})"), Pattern::random(seed2), None, true));
        for p in [u64::MAX, 0] {
            s.push(Step::Write(Pattern::solid(p)));
            s.push(Step::Pause(fade));
            s.push(check(format!("bit fade {p:#018x} after {} s", fade.as_secs()), Pattern::solid(p), None, false));
        }
    }
    s
}

/// The memory the test covers: chunks of `cuMemAlloc` memory up to `bytes` together. Chunks
/// rather than one allocation: a GPU's free memory is rarely one free range, and a 1 GiB chunk
/// keeps each launch short.
fn allocate(ctx: &Arc<Ctx>, bytes: usize) -> cuda::Result<Vec<DeviceBuffer>> {
    const CHUNK: usize = 1 << 30;
    const SMALLEST: usize = 64 << 20;
    let mut chunks = Vec::new();
    let mut left = bytes;
    let mut size = CHUNK;
    while left >= SMALLEST.min(bytes) && left > 0 {
        let want = size.min(left) & !((2 << 20) - 1);
        let want = if want == 0 { left & !7 } else { want };
        match ctx.alloc(want) {
            Ok(b) => {
                left -= want;
                chunks.push(b);
            }
            Err(e) if e.code == cuda::code::OUT_OF_MEMORY && size > SMALLEST => size /= 2,
            Err(e) if e.code == cuda::code::OUT_OF_MEMORY && !chunks.is_empty() => break,
            Err(e) => return Err(e),
        }
    }
    Ok(chunks)
}

/// One GPU's memory test as it runs: its chunks, the buffer that evicts its L2, its stream and
/// the passes checked so far. `memtest_all` runs every GPU's at once.
pub(crate) struct Memtest<'m> {
    ctx: Arc<Ctx>,
    k: &'m Loaded,
    chunks: Vec<DeviceBuffer>,
    evict: Option<DeviceBuffer>,
    write: Function<'m>,
    check: Function<'m>,
    result: DeviceBuffer,
    host: PinnedBuffer,
    stream: Stream,
    t0: cuda::Event,
    t1: cuda::Event,
    passes: Vec<MemtestPass>,
    seed: u64,
}

impl<'m> Memtest<'m> {
    /// Allocates the test's memory: at most `cap` bytes, and at most 90% of what is free once
    /// the eviction buffer is taken.
    pub fn new(ctx: &Arc<Ctx>, k: &'m Loaded, cap: usize, seed: u64) -> cuda::Result<Memtest<'m>> {
        // Twice the L2, written between passes: a write-back cache keeps the last lines written
        // and serves them to the next pass, so without it the pass after one that ended there
        // would read up to an L2 of the cache instead of HBM (PTX ISA, "Cache Operators": `.cg`
        // caches in L2; Hopper's L2 is 50 MB on the H100, its architecture whitepaper).
        let evict = match k.l2_bytes {
            0 => None,
            l2 => Some(ctx.alloc((2 * l2).next_multiple_of(8))?),
        };
        let (free, _) = ctx.mem_info()?;
        // Room for the driver, the result buffer and what the other probes hold: 90% of free.
        let bytes = cap.min(free / 10 * 9);
        let chunks = allocate(ctx, bytes)?;
        let t = Memtest {
            ctx: ctx.clone(),
            k,
            chunks,
            evict,
            write: k.module.function("phq_mem_write")?,
            check: k.module.function("phq_mem_check")?,
            result: ctx.alloc(256)?,
            host: ctx.pinned(256)?,
            stream: ctx.stream()?,
            t0: ctx.event()?,
            t1: ctx.event()?,
            passes: Vec::new(),
            seed,
        };
        t.stream.record(&t.t0)?;
        Ok(t)
    }

    /// Writes the eviction buffer: what the L2 held before is written back to HBM and gone.
    fn evict(&self) -> cuda::Result<()> {
        let Some(e) = &self.evict else { return Ok(()) };
        let args = [Arg::U64(e.ptr()), Arg::U64((e.len() / 8) as u64), Arg::U32(0), Arg::U64(0)];
        // SAFETY: the kernel writes the live eviction buffer's words, which outlives the stream.
        unsafe { self.stream.launch(&self.write, self.k.grid, BLOCK, &args) }
    }

    /// Queues `step` on the GPU; `after_pause`: the step before was a pause, which evicted.
    fn queue(&self, step: &Step, after_pause: bool) -> cuda::Result<()> {
        match step {
            Step::Write(p) => {
                for c in &self.chunks {
                    let args = [Arg::U64(c.ptr()), Arg::U64((c.len() / 8) as u64), Arg::U32(p.mode), Arg::U64(p.arg)];
                    // SAFETY: the kernel writes `words` 64-bit words from the chunk's start, all
                    // inside the live chunk, which outlives the stream.
                    unsafe { self.stream.launch(&self.write, self.k.grid, BLOCK, &args) }?;
                }
                Ok(())
            }
            // The pattern's last lines go to HBM before the wait, or they would wait in the L2,
            // where nothing fades.
            Step::Pause(_) => self.evict(),
            Step::Check { want, then, descending, .. } => {
                if !after_pause {
                    self.evict()?;
                }
                self.stream.memset_d32(&self.result, 0, 0, 64)?;
                let order: Vec<&DeviceBuffer> =
                    if *descending { self.chunks.iter().rev().collect() } else { self.chunks.iter().collect() };
                let next = then.unwrap_or(Pattern { mode: u32::MAX, arg: 0 });
                for c in order {
                    let args = [
                        Arg::U64(c.ptr()),
                        Arg::U64((c.len() / 8) as u64),
                        Arg::U32(want.mode),
                        Arg::U64(want.arg),
                        Arg::U32(next.mode),
                        Arg::U64(next.arg),
                        Arg::U32(u32::from(*descending)),
                        Arg::U64(self.result.ptr()),
                    ];
                    // SAFETY: the kernel reads and writes the live chunk's words and at most
                    // 200 bytes of the live 256-byte result buffer.
                    unsafe { self.stream.launch(&self.check, self.k.grid, BLOCK, &args) }?;
                }
                // SAFETY: `host` is read only after the stream is synchronized (`finish`).
                unsafe { self.stream.copy_d2h(&self.host, 0, &self.result, 0, 200) }
            }
        }
    }

    /// Waits for `step` and keeps what a check found.
    fn finish(&mut self, step: &Step) -> cuda::Result<()> {
        self.stream.synchronize()?;
        if let Step::Check { name, .. } = step {
            self.passes.push(read_pass(name, self.host.as_slice()));
        }
        Ok(())
    }

    pub fn result(self) -> cuda::Result<MemtestResult> {
        self.stream.record(&self.t1)?;
        self.stream.synchronize()?;
        let seconds = self.t0.elapsed_ms(&self.t1)? as f64 / 1000.0;
        let _ = &self.ctx;
        let passes = self.passes;
        let mismatches = passes.iter().map(|p| p.mismatches).sum();
        let first = passes.iter().find_map(|p| {
            p.first.first().map(|m| (m.address, format!("{:#018x} for {:#018x} in {}", m.read, m.expected, p.name)))
        });
        let mut ranges: Vec<[u64; 2]> = Vec::new();
        let mut spans: Vec<[u64; 2]> = self.chunks.iter().map(|c| [c.ptr(), c.ptr() + c.len() as u64]).collect();
        spans.sort_unstable();
        for r in spans {
            match ranges.last_mut() {
                Some(last) if last[1] == r[0] => last[1] = r[1],
                _ => ranges.push(r),
            }
        }
        Ok(MemtestResult {
            ranges,
            bytes_tested: self.chunks.iter().map(DeviceBuffer::len).sum::<usize>() as u64,
            patterns: passes.iter().map(|p| p.name.clone()).collect(),
            mismatches,
            first_mismatch: first,
            method: "kernels".into(),
            chunks: self.chunks.len(),
            seed: Some(self.seed),
            passes,
            seconds: Some(seconds),
        })
    }
}

/// Runs `steps` on every GPU of `runs` at once: each step queued on all of them, then waited
/// for on all, so the GPUs work side by side and a bit-fade pause is one pause for all — the
/// full level's two pauses take their time once, not once per GPU. A GPU that fails drops out
/// with its error; the others carry on.
pub(crate) fn memtest_all<E>(
    runs: &mut [(usize, Result<Memtest<'_>, E>)],
    steps: &[Step],
    fail: impl Fn(usize, cuda::CudaError) -> E,
) {
    let mut after_pause = false;
    for step in steps {
        for (gpu, r) in runs.iter_mut() {
            if let Ok(t) = r {
                if let Err(e) = t.queue(step, after_pause) {
                    *r = Err(fail(*gpu, e));
                }
            }
        }
        for (gpu, r) in runs.iter_mut() {
            if let Ok(t) = r {
                if let Err(e) = t.finish(step) {
                    *r = Err(fail(*gpu, e));
                }
            }
        }
        if let Step::Pause(d) = step {
            if runs.iter().any(|(_, r)| r.is_ok()) {
                std::thread::sleep(*d);
            }
        }
        after_pause = matches!(step, Step::Pause(_));
    }
}

/// Runs the memory test on one GPU over at most `cap` bytes (and at most 90% of free memory).
pub(crate) fn memtest(
    ctx: &Arc<Ctx>,
    k: &Loaded,
    steps: &[Step],
    cap: usize,
    seed: u64,
) -> cuda::Result<MemtestResult> {
    let mut runs = [(0, Memtest::new(ctx, k, cap, seed))];
    memtest_all(&mut runs, steps, |_, e| e);
    let [(_, r)] = runs;
    r?.result()
}

/// A check kernel's result buffer (`phq_mem_check`, `phq_gemm_check`): the count, then up to 8
/// (address or element, read, expected) records, sorted by address. The kernel keeps the
/// mismatches that took the first eight tickets of its atomic counter, which is the GPU's
/// scheduling order, not the lowest addresses: so what is reported is "the lowest of the N
/// kept", never "the first".
pub(crate) fn read_result(b: &[u8]) -> (u64, Vec<super::Mismatch>) {
    let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    let count = word(0);
    let mut kept: Vec<super::Mismatch> = (0..count.min(8) as usize)
        .map(|s| super::Mismatch { address: word(1 + 3 * s), read: word(2 + 3 * s), expected: word(3 + 3 * s) })
        .collect();
    kept.sort_by_key(|m| m.address);
    (count, kept)
}

/// Every 64-bit word of `buf` compared on the GPU with `word` (`phq_mem_check`, solid pattern, no
/// rewrite), on `stream`: how many differ, and the first few (address, read, expected).
pub(crate) fn check_solid(
    stream: &Stream,
    k: &Loaded,
    buf: &DeviceBuffer,
    word: u64,
) -> cuda::Result<(u64, Vec<super::Mismatch>)> {
    let ctx = stream.context();
    let check = k.module.function("phq_mem_check")?;
    let (result, host) = (ctx.alloc(256)?, ctx.pinned(256)?);
    stream.memset_d32(&result, 0, 0, 64)?;
    let p = Pattern::solid(word);
    let args = [
        Arg::U64(buf.ptr()),
        Arg::U64((buf.len() / 8) as u64),
        Arg::U32(p.mode),
        Arg::U64(p.arg),
        Arg::U32(u32::MAX),
        Arg::U64(0),
        Arg::U32(0),
        Arg::U64(result.ptr()),
    ];
    // SAFETY: the kernel reads the live buffer's whole words and writes at most 200 bytes of the
    // live 256-byte result buffer; the stream is synchronized before either is dropped.
    unsafe { stream.launch(&check, k.grid, BLOCK, &args) }?;
    // SAFETY: `host` is read only after the stream is synchronized, below.
    unsafe { stream.copy_d2h(&host, 0, &result, 0, 200) }?;
    stream.synchronize()?;
    Ok(read_result(host.as_slice()))
}

fn read_pass(name: &str, b: &[u8]) -> MemtestPass {
    let (mismatches, first) = read_result(b);
    MemtestPass { name: name.to_string(), mismatches, first }
}

/// Holds a stream until the host lets it go, so a sample's copies run back to back from the
/// moment the host releases them (nvbandwidth's spin kernel).
pub(crate) struct Gate<'m> {
    spin: Function<'m>,
    /// Mapped host memory: the flag at byte 0, the kernel's timed-out status at byte 4.
    words: PinnedBuffer,
}

impl<'m> Gate<'m> {
    pub fn new(ctx: &Arc<Ctx>, k: &'m Loaded) -> cuda::Result<Gate<'m>> {
        Ok(Gate { spin: k.module.function("phq_spin")?, words: ctx.mapped(8)? })
    }

    /// Queues the spin kernel on `stream`: work queued after it waits for `release`.
    pub fn hold(&self, stream: &Stream) -> cuda::Result<()> {
        self.words.write_u32(0, 0);
        self.words.write_u32(4, 0);
        let dev = self.words.device_ptr().unwrap_or(0);
        let args = [Arg::U64(dev), Arg::U64(SPIN_TIMEOUT_NS), Arg::U64(dev + 4)];
        // SAFETY: both words lie in the live mapped buffer, which outlives every stream it
        // holds (the gate is dropped after the streams are synchronized).
        unsafe { stream.launch(&self.spin, 1, 1, &args) }
    }

    pub fn release(&self) {
        self.words.write_u32(0, 1);
    }

    /// Whether the last hold ran out before its release (the sample then includes the time the
    /// host took to queue it).
    pub fn timed_out(&self) -> bool {
        self.words.read_u32(4) != 0
    }
}

/// Latency by pointer chase: `steps` dependent loads through a chain of `nodes` pointers laid
/// `stride` bytes apart in `chain` (whose device address is `base`), built by `store`.
pub(crate) fn chain_words(base: u64, nodes: usize, stride: usize) -> Vec<u64> {
    // Node i points to node (i + 1) mod nodes; every node on its own 4 KiB page or more, so
    // each load is its own transaction.
    let per = stride / 8;
    let mut words = vec![0u64; nodes * per];
    for i in 0..nodes {
        words[i * per] = base + (((i + 1) % nodes) * stride) as u64;
    }
    words
}

/// `phq_sgemm`'s launch contract (kernels.ptx): n a positive multiple of 16, one 256-thread
/// block per 16×16 tile of C, as a 1-D grid of (n/16)² blocks (at most 2^31 − 1, the grid's
/// x limit: PG, "Compute Capabilities"). Any other shape computes a wrong product or reads past
/// the matrices, and no error says so: the host refuses it before launching.
pub(crate) fn sgemm_shape(n: usize) -> Result<(u32, u32), String> {
    if n == 0 || !n.is_multiple_of(16) {
        return Err(format!("phq_sgemm: n = {n} is not a positive multiple of 16"));
    }
    let tiles = (n / 16) as u64;
    let grid = u32::try_from(tiles * tiles).ok().filter(|g| *g <= i32::MAX as u32);
    let grid = grid.ok_or(format!("phq_sgemm: n = {n} needs more than 2^31 − 1 blocks"))?;
    Ok((grid, 256))
}

/// The chain: at least as many nodes as a sample takes steps (`cuda::LATENCY_STEPS`), so no
/// node is loaded twice in a sample — a second load of a line would come from the L2.
/// `phq_mma_gemm`'s launch contract (tensor.ptx): n a positive multiple of 16, four warps (128
/// threads) a block, one warp per 16 × 8 tile of C, so a 1-D grid of ceil(n² / 512) blocks.
pub(crate) fn mma_shape(n: usize) -> Result<(u32, u32), String> {
    if n == 0 || !n.is_multiple_of(16) {
        return Err(format!("phq_mma_gemm: n = {n} is not a positive multiple of 16"));
    }
    let tiles = (n as u64 / 16) * (n as u64 / 8);
    let grid = u32::try_from(tiles.div_ceil(4)).ok().filter(|g| *g <= i32::MAX as u32);
    let grid = grid.ok_or(format!("phq_mma_gemm: n = {n} needs more than 2^31 − 1 blocks"))?;
    Ok((grid, 128))
}

pub(crate) const CHASE_NODES: usize = 2048;
pub(crate) const CHASE_STRIDE: usize = 4096;

/// A GPU's L2 emptied of the chain before each latency sample: twice its size written by
/// `phq_mem_write` on its own stream. Device memory is coherent at the L2 of the GPU that owns
/// it, and `ld.cv` refetches only system memory (PTX ISA, "Cache Operators"), so a chain still
/// in that L2 — the lines its upload or the last sample left there — times the L2, not HBM or
/// NVLink.
pub(crate) struct Evict<'m> {
    write: Function<'m>,
    buffer: DeviceBuffer,
    stream: Stream,
    grid: u32,
}

impl<'m> Evict<'m> {
    /// For the GPU of `ctx`, whose kernels are `k`; `None` where the L2's size is unknown (0).
    pub fn new(ctx: &Arc<Ctx>, k: &'m Loaded) -> cuda::Result<Option<Evict<'m>>> {
        if k.l2_bytes == 0 {
            return Ok(None);
        }
        let buffer = ctx.alloc((2 * k.l2_bytes).next_multiple_of(8))?;
        Ok(Some(Evict { write: k.module.function("phq_mem_write")?, buffer, stream: ctx.stream()?, grid: k.grid }))
    }

    fn run(&self) -> cuda::Result<()> {
        let args = [Arg::U64(self.buffer.ptr()), Arg::U64((self.buffer.len() / 8) as u64), Arg::U32(0), Arg::U64(0)];
        // SAFETY: the kernel writes the live buffer's words; the stream is synchronized below,
        // before the buffer can be dropped.
        unsafe { self.stream.launch(&self.write, self.grid, BLOCK, &args) }?;
        self.stream.synchronize()
    }
}

/// Nanoseconds per dependent load from GPU `stream`'s kernel through the chain at `start`, the
/// L2 owning the chain evicted before each sample (`evict`; none for host memory).
pub(crate) fn chase_ns(
    stream: &Stream,
    k: &Loaded,
    start: u64,
    out: &DeviceBuffer,
    steps: u64,
    samples: u32,
    evict: Option<&Evict<'_>>,
) -> cuda::Result<Vec<f64>> {
    let f = k.module.function("phq_chase")?;
    let ctx = stream.context();
    let (a, b) = (ctx.event()?, ctx.event()?);
    let args = [Arg::U64(start), Arg::U64(steps / 10), Arg::U64(out.ptr())];
    // SAFETY: the chain's every pointer addresses a node of the live chain buffer; `out` is a
    // live 8-byte-or-larger device buffer. Warm-up, untimed.
    unsafe { stream.launch(&f, 1, 1, &args) }?;
    stream.synchronize()?;
    let mut out_ns = Vec::new();
    for _ in 0..samples {
        if let Some(e) = evict {
            e.run()?;
        }
        stream.record(&a)?;
        let args = [Arg::U64(start), Arg::U64(steps), Arg::U64(out.ptr())];
        // SAFETY: as above.
        unsafe { stream.launch(&f, 1, 1, &args) }?;
        stream.record(&b)?;
        stream.synchronize()?;
        out_ns.push(a.elapsed_ms(&b)? as f64 * 1e6 / steps as f64);
    }
    Ok(out_ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProbeLevel;

    #[test]
    fn the_sgemm_launch_contract() {
        assert_eq!(sgemm_shape(16), Ok((1, 256)));
        assert_eq!(sgemm_shape(48), Ok((9, 256)));
        assert_eq!(sgemm_shape(16384), Ok((1 << 20, 256)));
        assert!(sgemm_shape(40).unwrap_err().contains("multiple of 16"));
        assert!(sgemm_shape(0).is_err());
        assert!(sgemm_shape(16 << 20).unwrap_err().contains("2^31"));
    }

    #[test]
    fn levels_add_patterns_and_every_check_follows_a_write_of_its_pattern() {
        let fade = std::time::Duration::from_secs(60);
        let names = |l| -> Vec<String> {
            steps(l, 7, fade)
                .into_iter()
                .filter_map(|s| match s {
                    Step::Check { name, .. } => Some(name),
                    _ => None,
                })
                .collect()
        };
        let (q, s, f) = (names(ProbeLevel::Quick), names(ProbeLevel::Standard), names(ProbeLevel::Full));
        assert_eq!(q.len(), 3);
        assert!(s.len() > q.len() && f.len() > s.len());
        assert!(s.iter().any(|n| n.starts_with("moving inversions down")));
        assert!(f.iter().any(|n| n.starts_with("bit fade")));
        // Simulate the memory's pattern through the steps: each check expects what is there.
        for level in [ProbeLevel::Quick, ProbeLevel::Standard, ProbeLevel::Full] {
            let mut held = None;
            for st in steps(level, 7, fade) {
                match st {
                    Step::Write(p) => held = Some(p),
                    Step::Check { want, then, name, .. } => {
                        assert_eq!(held, Some(want), "{level:?}: {name}");
                        if then.is_some() {
                            held = then;
                        }
                    }
                    Step::Pause(_) => {}
                }
            }
        }
    }

    #[test]
    fn a_chain_visits_every_node_and_returns() {
        let base = 0x7000_0000u64;
        let w = chain_words(base, 4, 4096);
        let mut p = base;
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(p);
            p = w[((p - base) / 8) as usize];
        }
        assert_eq!(p, base);
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 4);
    }
}
