//! Copies and latency on the CUDA backend: host↔device, bidirectional, device-local by the
//! copy engines and by the SMs, GPU↔GPU peer copies (their data checked on the destination),
//! and the pointer chases that time a dependent load of host or peer memory.
//!
//! nvbandwidth's method: every copy of a sample is queued behind a spin kernel that holds the
//! stream until all are queued, then released, so they run back to back; CUDA events around
//! the batch time it.

use super::{on, CudaBackend};
use crate::cuda::{self, Ctx, Stream};
use crate::probe::kernels::{self, Gate, Loaded};
use crate::probe::levels::LevelParams;
use crate::probe::results::ProbeError;
use std::sync::Arc;

/// Runs `enqueue` once untimed, then `samples` times `copies_per_sample` copies between two
/// events of `stream`'s context; GB/s per sample for `bytes_per_copy` counted bytes each. With a
/// gate, each sample's copies wait behind the spin kernel until all are queued, so the host's
/// launch gaps stay out of the timing; a sample whose spin kernel timed out is dropped.
pub(super) fn timed(
    stream: &Stream,
    gate: Option<&Gate<'_>>,
    p: &LevelParams,
    bytes_per_copy: f64,
    mut enqueue: impl FnMut() -> cuda::Result<()>,
) -> cuda::Result<Vec<f64>> {
    enqueue()?; // warm-up, untimed
    stream.synchronize()?;
    let (start, end) = (stream.context().event()?, stream.context().event()?);
    let mut out = Vec::new();
    for _ in 0..p.samples {
        if let Some(g) = gate {
            g.hold(stream)?;
        }
        stream.record(&start)?;
        for _ in 0..p.copies_per_sample {
            enqueue()?;
        }
        stream.record(&end)?;
        if let Some(g) = gate {
            g.release();
        }
        stream.synchronize()?;
        if gate.is_some_and(|g| g.timed_out()) {
            tracing::warn!("a sample's spin kernel timed out before its copies were queued; sample dropped");
            continue;
        }
        let ms = start.elapsed_ms(&end)? as f64;
        out.push(bytes_per_copy * p.copies_per_sample as f64 / (ms / 1000.0) / 1e9);
    }
    Ok(out)
}

/// Host→device copies from pinned memory.
pub(super) fn h2d(ctx: &Arc<Ctx>, gate: Option<&Gate<'_>>, p: &LevelParams) -> cuda::Result<Vec<f64>> {
    let host = ctx.pinned(p.buffer_bytes)?;
    let dev = ctx.alloc(p.buffer_bytes)?;
    let stream = ctx.stream()?; // dropped (drained) before the buffers
    timed(&stream, gate, p, p.buffer_bytes as f64, || {
        // SAFETY: `host` outlives `stream`, which is drained when dropped; nothing writes it.
        unsafe { stream.copy_h2d(&dev, 0, &host, p.buffer_bytes) }
    })
}

pub(super) fn d2h(ctx: &Arc<Ctx>, gate: Option<&Gate<'_>>, p: &LevelParams) -> cuda::Result<Vec<f64>> {
    let host = ctx.pinned(p.buffer_bytes)?;
    let dev = ctx.alloc(p.buffer_bytes)?;
    let stream = ctx.stream()?;
    stream.memset_d32(&dev, 0, 0, p.buffer_bytes / 4)?;
    timed(&stream, gate, p, p.buffer_bytes as f64, || {
        // SAFETY: `host` outlives `stream` and is never read here.
        unsafe { stream.copy_d2h(&host, 0, &dev, 0, p.buffer_bytes) }
    })
}

/// Both directions at once on two streams joined by events; the sample's time is the whole
/// batch, its bytes both directions' copies.
pub(super) fn bidir(ctx: &Arc<Ctx>, gate: Option<&Gate<'_>>, p: &LevelParams) -> cuda::Result<Vec<f64>> {
    let (host_up, host_down) = (ctx.pinned(p.buffer_bytes)?, ctx.pinned(p.buffer_bytes)?);
    let (dev_up, dev_down) = (ctx.alloc(p.buffer_bytes)?, ctx.alloc(p.buffer_bytes)?);
    let (up, down) = (ctx.stream()?, ctx.stream()?);
    down.memset_d32(&dev_down, 0, 0, p.buffer_bytes / 4)?;
    down.synchronize()?;
    let (start, mid, end) = (ctx.event()?, ctx.event()?, ctx.event()?);
    let mut out = Vec::new();
    // Sample 0 is the warm-up, untimed.
    for sample in 0..=p.samples {
        if let Some(g) = gate.filter(|_| sample > 0) {
            g.hold(&up)?;
        }
        up.record(&start)?;
        down.wait(&start)?;
        for _ in 0..p.copies_per_sample {
            // SAFETY: the host buffers outlive both streams and are never read here.
            unsafe {
                up.copy_h2d(&dev_up, 0, &host_up, p.buffer_bytes)?;
                down.copy_d2h(&host_down, 0, &dev_down, 0, p.buffer_bytes)?;
            }
        }
        down.record(&mid)?;
        up.wait(&mid)?;
        up.record(&end)?;
        if let Some(g) = gate {
            g.release();
        }
        up.synchronize()?;
        if sample == 0 {
            continue;
        }
        if gate.is_some_and(|g| g.timed_out()) {
            tracing::warn!("a sample's spin kernel timed out before its copies were queued; sample dropped");
            continue;
        }
        let ms = start.elapsed_ms(&end)? as f64;
        out.push(2.0 * p.buffer_bytes as f64 * p.copies_per_sample as f64 / (ms / 1000.0) / 1e9);
    }
    Ok(out)
}

pub(super) fn d2d(ctx: &Arc<Ctx>, gate: Option<&Gate<'_>>, p: &LevelParams) -> cuda::Result<Vec<f64>> {
    let (src, dst) = (ctx.alloc(p.buffer_bytes)?, ctx.alloc(p.buffer_bytes)?);
    let stream = ctx.stream()?;
    stream.memset_d32(&src, 0, 0, p.buffer_bytes / 4)?;
    // A device copy reads and writes every byte: count both, as DCGM's figures do.
    timed(&stream, gate, p, 2.0 * p.buffer_bytes as f64, || stream.copy_d2d(&dst, &src, p.buffer_bytes))
}

/// The same copy by the SMs: `phq_copy_sm`, 16 bytes per access, a grid that fills the GPU.
pub(super) fn sm_copy(ctx: &Arc<Ctx>, k: &Loaded, gate: &Gate<'_>, p: &LevelParams) -> cuda::Result<Vec<f64>> {
    let (src, dst) = (ctx.alloc(p.buffer_bytes)?, ctx.alloc(p.buffer_bytes)?);
    let stream = ctx.stream()?;
    stream.memset_d32(&src, 0, 0x5a5a_5a5a, p.buffer_bytes / 4)?;
    let copy = k.module.function("phq_copy_sm")?;
    let args = [cuda::Arg::U64(dst.ptr()), cuda::Arg::U64(src.ptr()), cuda::Arg::U64((p.buffer_bytes / 16) as u64)];
    timed(&stream, Some(gate), p, 2.0 * p.buffer_bytes as f64, || {
        // SAFETY: both buffers hold `buffer_bytes` (16-byte aligned by cuMemAlloc) and outlive
        // the stream.
        unsafe { stream.launch(&copy, k.grid, kernels::BLOCK, &args) }
    })
}

/// Nanoseconds per dependent load of mapped host memory from a kernel (nvbandwidth's
/// host-device latency test does the same: a pointer chase through host memory).
pub(super) fn host_latency(ctx: &Arc<Ctx>, k: &Loaded, p: &LevelParams) -> cuda::Result<Vec<f64>> {
    let mut chain = ctx.mapped(kernels::CHASE_NODES * kernels::CHASE_STRIDE)?;
    let base = chain.device_ptr().unwrap_or(0);
    let words = kernels::chain_words(base, kernels::CHASE_NODES, kernels::CHASE_STRIDE);
    for (dst, w) in chain.as_mut_slice().chunks_exact_mut(8).zip(&words) {
        dst.copy_from_slice(&w.to_le_bytes());
    }
    let out = ctx.alloc(8)?;
    let stream = ctx.stream()?;
    kernels::chase_ns(&stream, k, base, &out, LATENCY_STEPS, p.samples, None)
}

/// Dependent loads per latency sample: about 2 ms at a microsecond each, a thousand times CUDA
/// events' resolution (about half a microsecond, CUDA runtime API, cudaEventElapsedTime), and
/// short enough that 56 pairs of an HGX stay within the quick level's budget.
pub(crate) const LATENCY_STEPS: u64 = 2_000;

impl CudaBackend {
    /// A chain in `dst`'s memory, chased by a kernel on `src` (peer access is enabled by `p2p`,
    /// which runs first; enabling it again is harmless).
    pub(super) fn peer_chase(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        // Both GPUs' kernels: the chase runs on `src`, the eviction of the chain's L2 on `dst`.
        let (b, _) = self.with_kernels(dst)?;
        let (a, _) = self.with_kernels(src)?;
        let loaded = |g: usize| self.kernels.get(&g).and_then(|x| x.as_ref().ok());
        let (Some(k), Some(kd)) = (loaded(src), loaded(dst)) else {
            return Err(ProbeError::Unavailable("the probe kernels are not loaded".into()));
        };
        let evict = kernels::Evict::new(&b, kd).map_err(on(dst))?;
        a.enable_peer_access(&b).map_err(on(src))?;
        let chain = b.alloc(kernels::CHASE_NODES * kernels::CHASE_STRIDE).map_err(on(dst))?;
        let words = kernels::chain_words(chain.ptr(), kernels::CHASE_NODES, kernels::CHASE_STRIDE);
        let mut staging = b.pinned(chain.len()).map_err(on(dst))?;
        for (d, w) in staging.as_mut_slice().chunks_exact_mut(8).zip(&words) {
            d.copy_from_slice(&w.to_le_bytes());
        }
        {
            let up = b.stream().map_err(on(dst))?;
            // SAFETY: `staging` lives until `up` is synchronized just below.
            unsafe { up.copy_h2d(&chain, 0, &staging, chain.len()) }.map_err(on(dst))?;
            up.synchronize().map_err(on(dst))?;
        }
        let out = a.alloc(8).map_err(on(src))?;
        let stream = a.stream().map_err(on(src))?;
        kernels::chase_ns(&stream, k, chain.ptr(), &out, LATENCY_STEPS, p.samples, evict.as_ref()).map_err(on(src))
    }

    /// GPU `src` writes into GPU `dst`'s memory: a stream, events and the source buffer in
    /// `src`'s context, the destination allocated in `dst`'s, peer access from `src` to `dst`.
    /// Timed peer copies `src` → `dst`, and then their data checked on `dst`: a path that reports
    /// peer access but drops the writes (PCIe ACS sending P2P to an IOMMU that discards it) copies
    /// at full speed and delivers nothing, which only the data shows.
    pub(super) fn peer_copies(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        // What the source sends; the destination holds zeros before, so a copy that never
        // lands is seen in every word.
        const SENT: u32 = 0x5a5a_c3c3;
        let (a, b) = (self.ctx(src)?, self.ctx(dst)?);
        let to = b.alloc(p.buffer_bytes).map_err(on(dst))?;
        let words = p.buffer_bytes / 4;
        b.stream().and_then(|s| s.memset_d32(&to, 0, 0, words).and_then(|()| s.synchronize())).map_err(on(dst))?;
        a.enable_peer_access(&b).map_err(on(src))?;
        let from = a.alloc(p.buffer_bytes).map_err(on(src))?;
        let samples = self.gated(src, |a, gate| {
            let stream = a.stream()?;
            stream.memset_d32(&from, 0, SENT, words)?;
            timed(&stream, gate, p, p.buffer_bytes as f64, || stream.copy_peer(&to, &from, p.buffer_bytes))
        })?;
        let (ctx, k) = match self.with_kernels(dst) {
            Ok(loaded) => loaded,
            // Without the kernels the rate stands alone.
            Err(ProbeError::Unavailable(_)) => return Ok(samples),
            Err(e) => return Err(e),
        };
        let stream = ctx.stream().map_err(on(dst))?;
        let (wrong, kept) = kernels::check_solid(&stream, k, &to, u64::from(SENT) * 0x1_0000_0001).map_err(on(dst))?;
        if wrong > 0 {
            let first = kept
                .first()
                .map(|m| format!(" (first at {:#x}: {:#018x}, for {:#018x})", m.address, m.read, m.expected))
                .unwrap_or_default();
            return Err(ProbeError::Cuda(format!(
                "the copies' data did not arrive: {wrong} of {} words on GPU {dst} are not what GPU {src} sent{first}",
                p.buffer_bytes / 8
            )));
        }
        Ok(samples)
    }
}
