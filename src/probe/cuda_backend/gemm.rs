//! The GEMMs on the CUDA backend: FP32 (cuBLAS's SGEMM, or the agent's `phq_sgemm` where the
//! toolkit's cuBLAS is missing), BF16 and FP16 on the tensor cores (cuBLAS's GemmEx or the
//! agent's `phq_mma_gemm`), and all GPUs at once for the full level's sustained load. Every
//! product is checked exactly: its inputs are small integers, so the GPU must match the host to
//! the bit.

use super::{on, CudaBackend};
use crate::cuda::{self, BlasHandle, Ctx, CudaError, DeviceBuffer, Function, PinnedBuffer, Stream};
use crate::probe::backend::Half;
use crate::probe::kernels::{self, Loaded};
use crate::probe::levels::LevelParams;
use crate::probe::results::{GemmResult, ProbeError};
use std::sync::Arc;

/// GEMM inputs: small integers in [-8, 8] (sign, exponent and mantissa bits all change from one
/// to the next), so every product and every sum of up to 2^17 of them is an integer below 2^24
/// and exact in FP32: the GPU must match the host to the bit. An entry depends on its row and
/// column modulo 17 only, which lets the host build columns by copying and know the exact
/// product from a 17×17 table. A fault that swaps rows 17 apart would go unseen here; a check
/// on the device that compares every entry is the device-kernels work's.
fn gemm_value(row: usize, col: usize, salt: usize) -> i64 {
    (((row % 17) * 12 + (col % 17) * 3 + salt) % 17) as i64 - 8
}

const SALT_A: usize = 1;
const SALT_B: usize = 5;

/// Column 0 of a matrix and 17 more rows, as bytes of FP32 entries (FP64 when `size` is 8):
/// column j is the `n` values starting at row `13·j mod 17` (12·13 ≡ 3 mod 17, so shifting by
/// 13·j rows adds the 3·j of column j).
fn gemm_base_column(n: usize, salt: usize, size: usize) -> Vec<u8> {
    (0..n + 17)
        .flat_map(|r| {
            let v = gemm_value(r, 0, salt);
            if size == 8 {
                (v as f64).to_ne_bytes().to_vec()
            } else {
                (v as f32).to_ne_bytes().to_vec()
            }
        })
        .collect()
}

fn gemm_column(base: &[u8], n: usize, col: usize, size: usize) -> &[u8] {
    let shift = (13 * col) % 17;
    &base[shift * size..(shift + n) * size]
}

/// C's exact entries: `[i % 17][j % 17]`, each summed over all `n` products.
fn gemm_reference(n: usize) -> Vec<[i64; 17]> {
    (0..17)
        .map(|i| std::array::from_fn(|j| (0..n).map(|k| gemm_value(i, k, SALT_A) * gemm_value(k, j, SALT_B)).sum()))
        .collect()
}

/// Fills an n×n column-major matrix of `size`-byte entries (FP32 or FP64) on the device, a
/// staging buffer of whole columns at a time.
fn upload_matrix(
    stream: &Stream,
    staging: &mut PinnedBuffer,
    m: &DeviceBuffer,
    (n, size): (usize, usize),
    salt: usize,
) -> cuda::Result<()> {
    let base = gemm_base_column(n, salt, size);
    let line = n * size;
    let per = (staging.len() / line).max(1);
    let mut col = 0;
    while col < n {
        let k = per.min(n - col);
        for c in 0..k {
            staging.as_mut_slice()[c * line..(c + 1) * line].copy_from_slice(gemm_column(&base, n, col + c, size));
        }
        // SAFETY: the staging buffer is not touched again until the stream is synchronized.
        unsafe { stream.copy_h2d(m, col * line, staging, k * line) }?;
        stream.synchronize()?;
        col += k;
    }
    Ok(())
}

impl Half {
    /// `v`, an integer from −8 to 8, in this format: BF16 is FP32's top half (8 bits of
    /// mantissa); FP16 has FP32's sign, the exponent rebiased from 127 to 15 and the top ten
    /// bits of the mantissa (IEEE 754 binary16). Both are exact for these integers, so the
    /// product is the FP32 GEMM's either way.
    fn bits(self, v: i64) -> u16 {
        let b = (v as f32).to_bits();
        match (self, v) {
            (Half::Bf16, _) => (b >> 16) as u16,
            (Half::Fp16, 0) => 0,
            (Half::Fp16, _) => {
                ((b >> 16) & 0x8000 | ((((b >> 23) & 0xff) - 127 + 15) << 10) | ((b >> 13) & 0x3ff)) as u16
            }
        }
    }
}

/// Fills an n×n 16-bit matrix on the device: A row-major (each row contiguous), B column-major,
/// the values of `gemm_value` — integers from −8 to 8, exact in BF16 and FP16 — so the product
/// is the FP32 GEMM's, and `phq_gemm_check` checks it against the same table.
fn upload_half(
    stream: &Stream,
    staging: &mut PinnedBuffer,
    m: &DeviceBuffer,
    (n, salt): (usize, usize),
    row_major: bool,
    half: Half,
) -> cuda::Result<()> {
    let per = (staging.len() / (n * 2)).max(1);
    let mut line = 0;
    while line < n {
        let k = per.min(n - line);
        for l in 0..k {
            half_line(&mut staging.as_mut_slice()[l * n * 2..(l + 1) * n * 2], line + l, (salt, row_major), half);
        }
        // SAFETY: the staging buffer is not touched again until the stream is synchronized.
        unsafe { stream.copy_h2d(m, line * n * 2, staging, k * n * 2) }?;
        stream.synchronize()?;
        line += k;
    }
    Ok(())
}

/// One row of A (`row_major`) or column of B, `dst.len() / 2` entries: `gemm_value` depends on
/// the position along the line modulo 17 only, so the first 17 entries are made and the rest
/// copied from them, doubling — a 16384² matrix is 17 values and a few dozen copies per line,
/// not 16384 conversions.
fn half_line(dst: &mut [u8], line: usize, (salt, row_major): (usize, bool), half: Half) {
    let period = dst.len().min(17 * 2);
    for (e, slot) in dst[..period].chunks_exact_mut(2).enumerate() {
        let (row, col) = if row_major { (line, e) } else { (e, line) };
        slot.copy_from_slice(&half.bits(gemm_value(row, col, salt)).to_ne_bytes());
    }
    let mut filled = period;
    while filled < dst.len() {
        let more = filled.min(dst.len() - filled);
        dst.copy_within(..more, filled);
        filled += more;
    }
}

/// How many entries of C each timed sample reads back and checks exactly.
const GEMM_CHECKED_PER_SAMPLE: usize = 1024;
pub(crate) const GEMM_SAMPLES: usize = 3;

/// What computes the GEMM: cuBLAS's SGEMM, or the agent's own PTX kernel where the toolkit's
/// cuBLAS is missing (a VM with the driver only).
enum Gemmer<'a> {
    Blas(BlasHandle),
    /// cuBLAS's `cublasGemmEx`, BF16 or FP16 in, FP32 summed: the tensor cores through the
    /// library.
    BlasHalf(BlasHandle, Half),
    Ptx(Function<'a>),
    /// The agent's tensor-core kernel (`tensor.ptx`): BF16 or FP16 in, FP32 accumulate.
    Mma(Function<'a>, Half),
    /// cuBLAS's DGEMM: FP64 throughout.
    BlasF64(BlasHandle),
    /// The agent's `phq_dgemm`: FP64 throughout, `phq_sgemm`'s tiles and launch.
    PtxF64(Function<'a>),
}

impl Gemmer<'_> {
    fn run(&self, stream: &Stream, n: usize, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer) -> cuda::Result<()> {
        match self {
            Gemmer::Blas(h) => h.sgemm(n, a, b, c),
            Gemmer::BlasHalf(h, half) => h.gemm_half(n, a, b, c, *half == Half::Fp16),
            Gemmer::BlasF64(h) => h.dgemm(n, a, b, c),
            Gemmer::Ptx(f) | Gemmer::Mma(f, _) | Gemmer::PtxF64(f) => {
                // The kernel's launch contract and the bytes of an input entry and of C: FP32
                // for phq_sgemm, FP64 for phq_dgemm, 16 bits in for phq_mma_gemm (whose last
                // argument picks FP16 over BF16) with FP32 out.
                let (shape, input, out, fp16) = match self {
                    Gemmer::Mma(_, half) => (kernels::mma_shape(n), 2, 4, Some(*half == Half::Fp16)),
                    Gemmer::PtxF64(_) => (kernels::sgemm_shape(n), 8, 8, None),
                    _ => (kernels::sgemm_shape(n), 4, 4, None),
                };
                let (grid, block) = shape.map_err(|e| ctx_error(&e))?;
                if a.len() < n * n * input || b.len() < n * n * input || c.len() < n * n * out {
                    return Err(ctx_error(&format!("the GEMM's matrices hold fewer than {n}×{n} entries")));
                }
                let mut args = vec![
                    cuda::Arg::U64(a.ptr()),
                    cuda::Arg::U64(b.ptr()),
                    cuda::Arg::U64(c.ptr()),
                    cuda::Arg::U32(n as u32),
                ];
                args.extend(fp16.map(|h| cuda::Arg::U32(u32::from(h))));
                // SAFETY: A and B hold n×n entries of the kernel's input type and C n×n of its
                // output (checked above), and the launch has the kernel's shape (`sgemm_shape`,
                // `mma_shape`; phq_dgemm's is phq_sgemm's) and its parameters, so every tile it
                // reads and writes lies inside them.
                unsafe { stream.launch(f, grid, block, &args) }
            }
        }
    }
}

/// One GPU's GEMM in progress: its inputs uploaded, what computes it, how each result is
/// checked, and the figures so far. The single-GPU probe and the sustained all-GPU load both
/// queue batches on it and finish them one sample at a time.
struct GemmRun<'a> {
    n: usize,
    ctx: Arc<Ctx>,
    stream: Stream,
    a: DeviceBuffer,
    b: DeviceBuffer,
    c: DeviceBuffer,
    gemmer: Gemmer<'a>,
    library: &'static str,
    /// Bytes of one entry of C: 4 (FP32), 8 (FP64).
    out: usize,
    /// On the GPU: the check kernel, the exact table, a result buffer and its host copy, the grid.
    device_check: Option<(Function<'a>, DeviceBuffer, DeviceBuffer, PinnedBuffer, u32)>,
    reference: Vec<[i64; 17]>,
    readback: PinnedBuffer,
    start: cuda::Event,
    end: cuda::Event,
    reps: u32,
    tflops: Vec<f64>,
    seconds: f64,
    checked: usize,
    wrong: u64,
    max_rel: f64,
    first_wrong: Option<String>,
    samples: usize,
}

impl<'a> GemmRun<'a> {
    fn new(
        ctx: &Arc<Ctx>,
        blas: Option<&Arc<cuda::Blas>>,
        k: Option<&'a Loaded>,
        n: usize,
    ) -> cuda::Result<GemmRun<'a>> {
        GemmRun::with(ctx, blas, k, n, None)
    }

    /// `tensor`: 16-bit inputs on the tensor cores (cuBLAS's GemmEx or the agent's
    /// `phq_mma_gemm`), else FP32.
    fn with(
        ctx: &Arc<Ctx>,
        blas: Option<&Arc<cuda::Blas>>,
        k: Option<&'a Loaded>,
        n: usize,
        tensor: Option<Half>,
    ) -> cuda::Result<GemmRun<'a>> {
        let bytes = n * n * 4;
        let input = if tensor.is_some() { n * n * 2 } else { bytes };
        let (a, b, c) = (ctx.alloc(input)?, ctx.alloc(input)?, ctx.alloc(bytes)?);
        let mut staging = ctx.pinned((16 << 20).max(n * 4).min(bytes))?;
        let stream = ctx.stream()?;
        if let Some(half) = tensor {
            // The agent's kernel reads A by rows; cuBLAS reads column-major, as B is.
            upload_half(&stream, &mut staging, &a, (n, SALT_A), blas.is_none(), half)?;
            upload_half(&stream, &mut staging, &b, (n, SALT_B), false, half)?;
        } else {
            upload_matrix(&stream, &mut staging, &a, (n, 4), SALT_A)?;
            upload_matrix(&stream, &mut staging, &b, (n, 4), SALT_B)?;
        }
        let reference = gemm_reference(n);
        let (gemmer, library) = match (blas, k, tensor) {
            (Some(blas), _, Some(half)) => {
                let name = if half == Half::Fp16 { CUBLAS_FP16_GEMM } else { CUBLAS_BF16_GEMM };
                (Gemmer::BlasHalf(BlasHandle::new(blas, &stream)?, half), name)
            }
            (_, Some(k), Some(half)) => match &k.tensor {
                Ok(m) => {
                    let name = if half == Half::Fp16 { PTX_MMA_FP16_GEMM } else { PTX_MMA_GEMM };
                    (Gemmer::Mma(m.function("phq_mma_gemm")?, half), name)
                }
                Err(why) => return Err(ctx_error(why)),
            },
            (_, None, Some(_)) => return Err(ctx_error("the tensor-core GEMM needs the probe kernels")),
            (Some(blas), _, None) => (Gemmer::Blas(BlasHandle::new(blas, &stream)?), "cuBLAS SGEMM"),
            (None, Some(k), None) if n.is_multiple_of(16) => (Gemmer::Ptx(k.module.function("phq_sgemm")?), PTX_GEMM),
            _ => return Err(ctx_error("the GEMM needs cuBLAS or the probe kernels")),
        };
        let device_check = match k {
            Some(k) => {
                let table = ctx.alloc(17 * 17 * 4)?;
                let mut host = ctx.pinned(17 * 17 * 4)?;
                for (slot, v) in host.as_mut_slice().chunks_exact_mut(4).zip(reference.iter().flatten()) {
                    slot.copy_from_slice(&(*v as f32).to_ne_bytes());
                }
                // SAFETY: `host` lives until the synchronize just below.
                unsafe { stream.copy_h2d(&table, 0, &host, 17 * 17 * 4) }?;
                stream.synchronize()?;
                Some((k.module.function("phq_gemm_check")?, table, ctx.alloc(256)?, ctx.pinned(256)?, k.grid))
            }
            None => None,
        };
        GemmRun::assemble(ctx, stream, (n, a, b, c), (gemmer, library, 4), device_check, reference)
    }

    /// An FP64 GEMM (cuBLAS's DGEMM, else the agent's `phq_dgemm`): the same integer inputs in
    /// FP64, its products read back in part and checked on the host (`phq_gemm_check` compares
    /// FP32 words).
    fn fp64(
        ctx: &Arc<Ctx>,
        blas: Option<&Arc<cuda::Blas>>,
        k: Option<&'a Loaded>,
        n: usize,
    ) -> cuda::Result<GemmRun<'a>> {
        let bytes = n * n * 8;
        let (a, b, c) = (ctx.alloc(bytes)?, ctx.alloc(bytes)?, ctx.alloc(bytes)?);
        let mut staging = ctx.pinned((16 << 20).max(n * 8).min(bytes))?;
        let stream = ctx.stream()?;
        upload_matrix(&stream, &mut staging, &a, (n, 8), SALT_A)?;
        upload_matrix(&stream, &mut staging, &b, (n, 8), SALT_B)?;
        let (gemmer, library) = match (blas, k) {
            (Some(blas), _) => (Gemmer::BlasF64(BlasHandle::new(blas, &stream)?), CUBLAS_DGEMM),
            (None, Some(k)) if n.is_multiple_of(16) => (Gemmer::PtxF64(k.module.function("phq_dgemm")?), PTX_DGEMM),
            _ => return Err(ctx_error("the FP64 GEMM needs cuBLAS or the probe kernels")),
        };
        GemmRun::assemble(ctx, stream, (n, a, b, c), (gemmer, library, 8), None, gemm_reference(n))
    }

    /// A run from its parts, its figures empty: what `with` and `fp64` share.
    #[allow(clippy::type_complexity)]
    fn assemble(
        ctx: &Arc<Ctx>,
        stream: Stream,
        (n, a, b, c): (usize, DeviceBuffer, DeviceBuffer, DeviceBuffer),
        (gemmer, library, out): (Gemmer<'a>, &'static str, usize),
        device_check: Option<(Function<'a>, DeviceBuffer, DeviceBuffer, PinnedBuffer, u32)>,
        reference: Vec<[i64; 17]>,
    ) -> cuda::Result<GemmRun<'a>> {
        let (start, end) = (ctx.event()?, ctx.event()?);
        Ok(GemmRun {
            n,
            ctx: ctx.clone(),
            stream,
            a,
            b,
            c,
            gemmer,
            library,
            out,
            device_check,
            reference,
            readback: ctx.pinned(GEMM_CHECKED_PER_SAMPLE * 8)?,
            start,
            end,
            reps: 0,
            tflops: Vec::new(),
            seconds: 0.0,
            checked: 0,
            wrong: 0,
            max_rel: 0.0,
            first_wrong: None,
            samples: 0,
        })
    }

    /// One untimed product, waited for.
    fn warm_up(&self) -> cuda::Result<()> {
        self.gemmer.run(&self.stream, self.n, &self.a, &self.b, &self.c)?;
        self.stream.synchronize()
    }

    /// Queues `reps` products between the two events; returns at once.
    fn queue(&mut self, reps: u32) -> cuda::Result<()> {
        self.stream.record(&self.start)?;
        for _ in 0..reps {
            self.gemmer.run(&self.stream, self.n, &self.a, &self.b, &self.c)?;
        }
        self.stream.record(&self.end)?;
        self.reps = reps;
        Ok(())
    }

    /// Waits for the queued batch, keeps its rate and checks its product.
    fn finish(&mut self) -> cuda::Result<()> {
        let n = self.n;
        self.stream.synchronize()?;
        let ms = self.start.elapsed_ms(&self.end)? as f64;
        self.seconds += ms / 1000.0;
        self.tflops.push(2.0 * (n as f64).powi(3) * self.reps as f64 / (ms / 1000.0) / 1e12);
        let sample = self.samples;
        self.samples += 1;
        // phq_gemm_check indexes C's entries in 32 bits (kernels.ptx): n below 65536.
        let device_check = self.device_check.as_ref().filter(|_| n < 1 << 16);
        if let Some((f, table, result, host, grid)) = device_check {
            self.stream.memset_d32(result, 0, 0, 64)?;
            let args = [
                cuda::Arg::U64(self.c.ptr()),
                cuda::Arg::U32(n as u32),
                cuda::Arg::U64(table.ptr()),
                cuda::Arg::U64(result.ptr()),
            ];
            // SAFETY: C holds n×n floats, the table 17×17, the result 256 bytes: all live.
            unsafe { self.stream.launch(f, *grid, kernels::BLOCK, &args) }?;
            // SAFETY: `host` is read only after the synchronize below.
            unsafe { self.stream.copy_d2h(host, 0, result, 0, 200) }?;
            self.stream.synchronize()?;
            let b = host.as_slice();
            let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            let count = word(0);
            self.wrong += count;
            self.checked += n * n;
            if count > 0 {
                let (e, got, want) =
                    (word(1), f32::from_bits(word(2) as u32) as f64, f32::from_bits(word(3) as u32) as f64);
                self.max_rel = self.max_rel.max((got - want).abs() / want.abs().max(1.0));
                self.first_wrong.get_or_insert(format!("C[{}, {}] = {got} for {want}", e % n as u64, e / n as u64));
            }
            return Ok(());
        }
        // Without the kernels: scattered entries, different ones each sample, read back.
        let entries: Vec<(usize, usize)> = (0..GEMM_CHECKED_PER_SAMPLE)
            .map(|s| {
                let s = s + sample * GEMM_CHECKED_PER_SAMPLE;
                ((s * 7919 + 13) % n, (s * 104_729 + 7) % n)
            })
            .collect();
        let es = self.out;
        for (slot, (i, j)) in entries.iter().enumerate() {
            // SAFETY: `readback` is read only after the synchronize below.
            unsafe { self.stream.copy_d2h(&self.readback, slot * es, &self.c, (i + j * n) * es, es) }?;
        }
        self.stream.synchronize()?;
        for (slot, (i, j)) in entries.iter().enumerate() {
            let w = &self.readback.as_slice()[slot * es..slot * es + es];
            let got = match *w {
                [a, b, c, d, e, f, g, h] => f64::from_ne_bytes([a, b, c, d, e, f, g, h]),
                [a, b, c, d] => f32::from_ne_bytes([a, b, c, d]) as f64,
                _ => f64::NAN,
            };
            let want = self.reference[i % 17][j % 17];
            if got != want as f64 {
                self.wrong += 1;
                self.max_rel = self.max_rel.max((got - want as f64).abs() / (want.abs() as f64).max(1.0));
                self.first_wrong.get_or_insert(format!("C[{i}, {j}] = {got} for {want}"));
            }
            self.checked += 1;
        }
        Ok(())
    }

    fn result(self) -> GemmResult {
        let _ = &self.ctx;
        GemmResult {
            n: self.n,
            tflops_samples: self.tflops,
            max_rel_error: self.max_rel,
            checked_entries: self.checked,
            wrong_entries: self.wrong,
            library: self.library.into(),
            checked_on: if self.device_check.is_some() { "device" } else { "host" }.into(),
            first_wrong: self.first_wrong,
            seconds: self.seconds,
            cublas_cannot_start: None,
        }
    }
}

/// The GEMM probe: `samples` timed batches of `gemm_reps` products, every batch's product
/// checked — on the GPU, every entry against the exact 17×17 table (`phq_gemm_check`), when the
/// kernels are loaded; otherwise 1,024 scattered entries read back to the host.
fn gemm(
    ctx: &Arc<Ctx>,
    blas: Option<&Arc<cuda::Blas>>,
    k: Option<&Loaded>,
    p: &LevelParams,
) -> cuda::Result<GemmResult> {
    let n = gemm_side(p.gemm_n, blas.is_some());
    let mut run = GemmRun::new(ctx, blas, k, n)?;
    run.warm_up()?;
    for _ in 0..GEMM_SAMPLES {
        run.queue(p.gemm_reps)?;
        run.finish()?;
    }
    Ok(run.result())
}

/// GPU time a sustained batch lasts at least: the host checks a batch's product between
/// batches, and a GPU left waiting for that is not under load. A tenth of a second keeps the
/// gaps to a few per cent (the check reads C once: milliseconds).
const SUSTAINED_BATCH_S: f64 = 0.1;

/// Every GPU in `gpus` computing GEMMs at once for `secs` seconds of GPU time: batches queued
/// on all of them, then each finished and checked in turn, until every GPU has run `secs`.
/// A GPU that fails drops out with its error; the others carry on.
fn gemm_sustained(runs: &mut [(usize, Result<GemmRun<'_>, ProbeError>)], reps: u32, secs: f64) {
    let wall = std::time::Instant::now();
    // Each GPU's batch: `reps` at first, then as many products as fill SUSTAINED_BATCH_S at the
    // rate its last batch ran (a tensor-core GEMM of 4096² takes a fifth of a millisecond).
    let mut batch: Vec<u32> = vec![reps.max(1); runs.len()];
    // A bound on the host's wait whatever the events say: three times the asked time, plus a minute.
    let give_up = std::time::Duration::from_secs_f64(secs * 3.0 + 60.0);
    for (gpu, r) in runs.iter_mut() {
        if let Ok(run) = r {
            if let Err(e) = run.warm_up() {
                *r = Err(on(*gpu)(e));
            }
        }
    }
    loop {
        let going = runs.iter().any(|(_, r)| r.as_ref().is_ok_and(|g| g.seconds < secs));
        if !going || wall.elapsed() > give_up {
            break;
        }
        for ((gpu, r), n) in runs.iter_mut().zip(&batch) {
            if let Ok(run) = r {
                if run.seconds < secs {
                    if let Err(e) = run.queue(*n) {
                        *r = Err(on(*gpu)(e));
                    }
                }
            }
        }
        for ((gpu, r), n) in runs.iter_mut().zip(batch.iter_mut()) {
            if let Ok(run) = r {
                if run.reps > 0 {
                    let before = run.seconds;
                    if let Err(e) = run.finish() {
                        *r = Err(on(*gpu)(e));
                    } else {
                        let per = (run.seconds - before) / f64::from(run.reps);
                        if per > 0.0 {
                            let want = (SUSTAINED_BATCH_S / per).ceil().min(f64::from(u32::MAX / 2));
                            *n = (*n).max(want as u32).max(1);
                        }
                        run.reps = 0;
                    }
                }
            }
        }
    }
}

/// The library name a GEMM by the agent's own kernel reports.
pub(crate) const PTX_GEMM: &str = "PTX fallback (phq_sgemm)";

/// The side of the agent's own FP32 GEMM (`phq_sgemm`, where cuBLAS is missing) at a level whose
/// GEMM is `level_n`: half of it, an eighth of the work. Planned at `budget::PTX_SGEMM_TFLOPS`
/// (3) against cuBLAS's floors of 15 to 38 TFLOP/s, the level's own size took five to twelve
/// times cuBLAS's GEMM time and put the quick and standard levels over their budgets on an 8-GPU
/// HGX (`probe --dry-run`: 11.2 s of 10, 153.7 s of 120) and the full level at 1,025 s. Nothing
/// it proves is lost at half the side: no floor applies to this kernel (it is checked for right
/// results, every entry on the GPU), and 2048² is still 16,384 tiles of 16 × 16, over a hundred
/// waves of an H100's 132 SMs. Our choice; the halved side stays a multiple of the tile.
pub(crate) fn ptx_sgemm_n(level_n: usize) -> usize {
    level_n / 2
}

/// The side each GEMM of a level runs at: the level's through cuBLAS, `ptx_sgemm_n`'s on the
/// agent's own kernels (FP32, tensor-core and FP64 alike). The probes and the plan both ask here.
pub(crate) fn gemm_side(level_n: usize, cublas: bool) -> usize {
    if cublas {
        level_n
    } else {
        ptx_sgemm_n(level_n)
    }
}
/// The FP64 GEMM's names: cuBLAS's DGEMM, or the agent's `phq_dgemm`.
pub(crate) const CUBLAS_DGEMM: &str = "cuBLAS DGEMM";
pub(crate) const PTX_DGEMM: &str = "PTX fallback (phq_dgemm)";
/// … and by its tensor-core kernel.
pub(crate) const PTX_MMA_GEMM: &str = "PTX tensor cores, BF16 (phq_mma_gemm)";
/// … and the tensor-core GEMM through cuBLAS.
pub(crate) const CUBLAS_BF16_GEMM: &str = "cuBLAS GemmEx, BF16 (tensor cores)";
/// The same two with FP16 inputs.
pub(crate) const PTX_MMA_FP16_GEMM: &str = "PTX tensor cores, FP16 (phq_mma_gemm)";
pub(crate) const CUBLAS_FP16_GEMM: &str = "cuBLAS GemmEx, FP16 (tensor cores)";

/// cuBLAS for one GPU (`CudaBackend::blas_here`).
enum BlasHere {
    Ready(Arc<cuda::Blas>),
    /// Not installed: why the loader found none.
    Missing(String),
    /// Installed, and `cublasCreate` refused in this GPU's context: `cannot_start`'s text.
    CannotStart(String),
}

impl BlasHere {
    /// cuBLAS to use, or why not; and what a result must carry when it loads but cannot start.
    fn split(self) -> (Result<Arc<cuda::Blas>, String>, Option<String>) {
        match self {
            BlasHere::Ready(b) => (Ok(b), None),
            BlasHere::Missing(why) => (Err(why), None),
            BlasHere::CannotStart(why) => (Err(why.clone()), Some(why)),
        }
    }
}

impl GemmResult {
    fn with_cublas(self, cannot_start: Option<String>) -> GemmResult {
        GemmResult { cublas_cannot_start: cannot_start, ..self }
    }
}

fn ctx_error(text: &str) -> CudaError {
    CudaError { call: "gemm", code: 801, name: "CUDA_ERROR_NOT_SUPPORTED".into(), text: text.into(), sticky: false }
}

impl CudaBackend {
    /// cuBLAS for `gpu`: loaded, and a handle made once in its context (`cublasCreate` needs a
    /// current context, and is where cuBLAS's own CUDA runtime starts). A cuBLAS that loads but
    /// cannot start is left out as a missing one is, so the GEMMs run on the agent's kernels,
    /// and each result carries why (`probe.cublas`): the GPU is not at fault.
    fn blas_here(&mut self, gpu: usize, ctx: &Arc<Ctx>) -> Result<BlasHere, ProbeError> {
        let blas = match cuda::blas() {
            Ok(b) => b,
            Err(e) => return Ok(BlasHere::Missing(e.to_string())),
        };
        if !self.cublas.contains_key(&gpu) {
            let stream = ctx.stream().map_err(on(gpu))?;
            let tried = match BlasHandle::new(&blas, &stream) {
                Ok(_handle) => Ok(()),
                // A cuBLAS status, not a driver error: the library, not the GPU, refused.
                Err(e) if e.call.starts_with("cublas") => Err(self.cannot_start(&blas, &e)),
                Err(e) => return Err(on(gpu)(e)),
            };
            self.cublas.insert(gpu, tried);
        }
        Ok(match &self.cublas[&gpu] {
            Ok(()) => BlasHere::Ready(blas),
            Err(why) => BlasHere::CannotStart(why.clone()),
        })
    }

    /// What `probe.cublas` says: cuBLAS's version and file, its answer, the driver's CUDA.
    fn cannot_start(&self, blas: &cuda::Blas, e: &CudaError) -> String {
        let version = blas.version().map(|v| format!(" {v}")).unwrap_or_default();
        let driver = match self.drv.version() {
            Ok(v) => format!("the driver supports CUDA {}", crate::collect::cuda::version_string(v)),
            Err(e) => format!("the driver would not give its CUDA version ({e})"),
        };
        format!("cuBLAS{version} ({}) loads but cannot start: {e}; {driver}", blas.file.display())
    }

    /// cuBLAS when the toolkit's library loads and starts, else the agent's PTX GEMM; checked on
    /// the GPU when the kernels load.
    pub(super) fn gemm_fp32(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError> {
        let _near = self.near(gpu);
        let ctx = self.ctx(gpu)?;
        let here = self.blas_here(gpu, &ctx)?;
        let kernels = match self.with_kernels(gpu) {
            Ok((_, k)) => Some(k),
            Err(ProbeError::Unavailable(_)) => None,
            Err(e) => return Err(e),
        };
        let (blas, note) = here.split();
        match (&blas, kernels) {
            (Err(e), None) => Err(ProbeError::Unavailable(format!(
                "the GEMM probe needs cuBLAS (it ships with the CUDA toolkit: {e}) or the probe kernels, which the driver could not load"
            ))),
            (Err(e), Some(_)) if !p.gemm_n.is_multiple_of(16) => {
                Err(ProbeError::Unavailable(format!("no cuBLAS ({e}), and the PTX GEMM needs n a multiple of 16")))
            }
            _ => gemm(&ctx, blas.as_ref().ok(), kernels, p).map(|r| r.with_cublas(note)).map_err(on(gpu)),
        }
    }

    /// BF16 or FP16 on the tensor cores: cuBLAS's `cublasGemmEx` where the toolkit is there, the agent's
    /// `phq_mma_gemm` otherwise; every entry of every timed product checked on the GPU against
    /// the exact table (read back in part when the kernels cannot load).
    pub(super) fn gemm_half(&mut self, gpu: usize, p: &LevelParams, half: Half) -> Result<GemmResult, ProbeError> {
        let _near = self.near(gpu);
        let ctx = self.ctx(gpu)?;
        let (blas, note) = self.blas_here(gpu, &ctx)?.split();
        let blas = blas.ok();
        let k = match self.with_kernels(gpu) {
            Ok((_, k)) => Some(k),
            Err(ProbeError::Unavailable(_)) if blas.is_some() => None,
            Err(e) => return Err(e),
        };
        // The agent's tensor kernel at half the side, as its FP32 kernel: it ran at 19.6 TFLOP/s on
        // an H200 (docs/hardware-validation.md), so the level's full side would outlast its budget.
        let n = gemm_side(p.gemm_n, blas.is_some());
        if blas.is_none() {
            if let Some(Err(why)) = k.map(|k| &k.tensor) {
                return Err(ProbeError::Unavailable(format!("no cuBLAS, and {why}")));
            }
            if !n.is_multiple_of(16) {
                return Err(ProbeError::Unavailable(
                    "no cuBLAS, and the tensor kernel needs n a multiple of 16".into(),
                ));
            }
        }
        let mut run = GemmRun::with(&ctx, blas.as_ref(), k, n, Some(half)).map_err(on(gpu))?;
        run.warm_up().map_err(on(gpu))?;
        for _ in 0..GEMM_SAMPLES {
            run.queue(p.gemm_reps).map_err(on(gpu))?;
            run.finish().map_err(on(gpu))?;
        }
        Ok(run.result().with_cublas(note))
    }

    /// Every GPU at once (`gemm_sustained`) on the tensor cores: cuBLAS where it loads, the
    /// agent's tensor kernel elsewhere (FP32 only where neither can run).
    pub(super) fn gemm_all(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        self.all_at_once(gpus, p, secs, Load::Tensor)
    }

    /// Every GPU at once on FP64 GEMMs (`gemm_sustained`) for `secs` of GPU time each: cuBLAS's
    /// DGEMM where it loads and starts, the agent's `phq_dgemm` at `ptx_sgemm_n`'s side elsewhere.
    /// The load of DCGM's targeted-power test (DCGM's diag documentation, "Targeted Power":
    /// `use_dgemm`, large matrix multiplications on each GPU at once), while the caller samples
    /// the boards' power.
    pub(super) fn gemm_fp64_all(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        self.all_at_once(gpus, p, secs, Load::Fp64)
    }

    /// `load` on every GPU of `gpus` at once (`gemm_sustained`), each result with the reason
    /// cuBLAS could not start where it could not.
    fn all_at_once(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
        load: Load,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        // Contexts, cuBLAS and kernels first (they need `self` mutably); then the runs borrow
        // the kernels.
        let mut ready = Vec::new();
        let mut notes = std::collections::HashMap::new();
        for &g in gpus {
            let r = self.ctx(g).and_then(|c| {
                let (blas, note) = self.blas_here(g, &c)?.split();
                notes.insert(g, note);
                match self.with_kernels(g) {
                    Ok(_) => Ok((c, blas.ok(), true)),
                    Err(ProbeError::Unavailable(_)) => Ok((c, blas.ok(), false)),
                    Err(e) => Err(e),
                }
            });
            ready.push((g, r));
        }
        let loaded = &self.kernels;
        let mut runs: Vec<(usize, Result<GemmRun<'_>, ProbeError>)> = ready
            .into_iter()
            .map(|(g, r)| {
                let run = r.and_then(|(ctx, blas, has)| {
                    let k = if has { loaded.get(&g).and_then(|x| x.as_ref().ok()) } else { None };
                    load.run(g, &ctx, blas.as_ref(), k, p)
                });
                (g, run)
            })
            .collect();
        gemm_sustained(&mut runs, p.gemm_reps, secs);
        runs.into_iter().map(|(g, r)| (g, r.map(|run| run.result().with_cublas(notes.remove(&g).flatten())))).collect()
    }
}

/// What every GPU computes at once: the sustained load, or the power test's FP64.
#[derive(Clone, Copy)]
enum Load {
    Tensor,
    Fp64,
}

impl Load {
    /// GPU `gpu`'s run of this load, or why it cannot run there (`Unavailable` when neither
    /// cuBLAS nor the kernels can compute it: no fault of the GPU).
    fn run<'a>(
        self,
        gpu: usize,
        ctx: &Arc<Ctx>,
        blas: Option<&Arc<cuda::Blas>>,
        k: Option<&'a Loaded>,
        p: &LevelParams,
    ) -> Result<GemmRun<'a>, ProbeError> {
        let none = |what: &str| {
            ProbeError::Unavailable(format!(
                "the {what} needs cuBLAS (the CUDA toolkit) or the probe kernels, which the driver could not load"
            ))
        };
        match self {
            Load::Tensor => {
                if blas.is_none() && k.is_none() {
                    return Err(none("GEMM"));
                }
                // The tensor cores where cuBLAS or the tensor kernel can drive them: the load the
                // GPUs are bought for, at its power and heat; FP32 otherwise.
                let tensor = blas.is_some() || k.is_some_and(|k| k.tensor.is_ok() && p.gemm_n.is_multiple_of(16));
                GemmRun::with(ctx, blas, k, p.gemm_n, tensor.then_some(Half::Bf16)).map_err(on(gpu))
            }
            Load::Fp64 => {
                let n = gemm_side(p.gemm_n, blas.is_some());
                if blas.is_none() && (k.is_none() || !n.is_multiple_of(16)) {
                    return Err(none("FP64 GEMM"));
                }
                GemmRun::fp64(ctx, blas, k, n).map_err(on(gpu))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_columns_by_shifting_are_the_matrix_and_the_table_is_its_product() {
        let n = 40;
        for salt in [SALT_A, SALT_B] {
            let base = gemm_base_column(n, salt, 4);
            let base64 = gemm_base_column(n, salt, 8);
            for col in 0..n {
                let want: Vec<u8> = (0..n).flat_map(|r| (gemm_value(r, col, salt) as f32).to_ne_bytes()).collect();
                assert_eq!(gemm_column(&base, n, col, 4), &want[..], "column {col}");
                let want: Vec<u8> = (0..n).flat_map(|r| (gemm_value(r, col, salt) as f64).to_ne_bytes()).collect();
                assert_eq!(gemm_column(&base64, n, col, 8), &want[..], "FP64 column {col}");
            }
        }
        let table = gemm_reference(n);
        for (i, j) in [(0, 0), (5, 33), (39, 17), (16, 1)] {
            let want: i64 = (0..n).map(|k| gemm_value(i, k, SALT_A) * gemm_value(k, j, SALT_B)).sum();
            assert_eq!(table[i % 17][j % 17], want);
        }
        // A 16-bit line made from its first period is every entry's own value, either way.
        for (n, line, row_major) in [(40, 3, true), (40, 22, false), (16, 5, true), (17, 0, false), (1000, 999, true)] {
            for half in [Half::Bf16, Half::Fp16] {
                let mut got = vec![0u8; n * 2];
                half_line(&mut got, line, (SALT_B, row_major), half);
                let want: Vec<u8> = (0..n)
                    .flat_map(|e| {
                        let (row, col) = if row_major { (line, e) } else { (e, line) };
                        half.bits(gemm_value(row, col, SALT_B)).to_ne_bytes()
                    })
                    .collect();
                assert_eq!(got, want, "n {n}, line {line}, row_major {row_major}, {half:?}");
            }
        }
        // The values span [-8, 8], both signs.
        let vals: std::collections::BTreeSet<i64> = (0..17).map(|r| gemm_value(r, 0, SALT_A)).collect();
        assert_eq!((vals.first(), vals.last(), vals.len()), (Some(&-8), Some(&8), 17));
    }
}
