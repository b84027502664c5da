//! The memory test on the CUDA backend: the device-side test (`kernels.rs`) on every GPU at
//! once over 90% of its free memory, or, where the driver cannot load the kernels, `cuMemsetD32`
//! patterns read back to the host and compared there.

use super::{on, CudaBackend};
use crate::cuda::{self, Ctx};
use crate::probe::kernels;
use crate::probe::levels::LevelParams;
use crate::probe::results::{MemtestResult, ProbeError};
use std::sync::Arc;

/// Device memory is read back 64 MiB at a time; the host compare is a `memcmp` against the
/// expected bytes, and only a chunk that differs is scanned word by word.
const MEMTEST_CHUNK: usize = 64 << 20;
pub(crate) const MEMTEST_PATTERNS: [u32; 4] = [0x0000_0000, 0xFFFF_FFFF, 0xAAAA_AAAA, 0x5555_5555];

/// The fallback memory test, when the driver cannot load the kernels: `cuMemsetD32` patterns
/// over the level's `memtest_bytes`, read back to the host and compared there.
fn memory_readback(ctx: &Arc<Ctx>, p: &LevelParams) -> cuda::Result<MemtestResult> {
    let (free, _) = ctx.mem_info()?;
    // Leave room for the driver and other buffers: at most 90% of what is free.
    let bytes = p.memtest_bytes.min(free / 10 * 9) & !(MEMTEST_CHUNK - 1);
    let bytes = if bytes == 0 { p.memtest_bytes.min(free / 10 * 9) & !4095 } else { bytes };
    let chunk = MEMTEST_CHUNK.min(bytes);
    let dev = ctx.alloc(bytes)?;
    let host = ctx.pinned(chunk)?;
    let stream = ctx.stream()?;
    let mut expected = vec![0u8; chunk.max(4)];
    let mut mismatches = 0u64;
    let mut first = None;
    for pattern in MEMTEST_PATTERNS {
        // One word, then doubling copies: a memcpy's speed, whatever the build.
        expected[..4].copy_from_slice(&pattern.to_ne_bytes());
        let mut filled = 4;
        while filled < expected.len() {
            let k = filled.min(expected.len() - filled);
            expected.copy_within(..k, filled);
            filled += k;
        }
        stream.memset_d32(&dev, 0, pattern, bytes / 4)?;
        let mut off = 0;
        while off < bytes {
            let n = chunk.min(bytes - off);
            // SAFETY: `host` is read only after the stream is synchronized below.
            unsafe { stream.copy_d2h(&host, 0, &dev, off, n) }?;
            stream.synchronize()?;
            let got = &host.as_slice()[..n];
            if got != &expected[..n] {
                for (i, w) in got.chunks_exact(4).enumerate() {
                    let word = u32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
                    if word != pattern {
                        mismatches += 1;
                        first.get_or_insert(((off + i * 4) as u64, format!("{word:#010x} for {pattern:#010x}")));
                    }
                }
            }
            off += n;
        }
    }
    Ok(MemtestResult {
        bytes_tested: bytes as u64,
        patterns: MEMTEST_PATTERNS.iter().map(|p| format!("{p:#010x}")).collect(),
        mismatches,
        first_mismatch: first,
        method: "host read-back".into(),
        chunks: 1,
        seed: None,
        passes: Vec::new(),
        seconds: None,
        ranges: Vec::new(),
    })
}

impl CudaBackend {
    /// The device-side test over 90% of free memory; the host read-back of `memtest_bytes` when
    /// the kernels cannot load.
    pub(super) fn memtest_one(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError> {
        let _near = self.near(gpu);
        let level = self.level;
        match self.with_kernels(gpu) {
            Ok((ctx, k)) => {
                let seed = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0x5eed);
                let steps = kernels::steps(level, seed, std::time::Duration::from_secs(p.fade_secs.into()));
                kernels::memtest(&ctx, k, &steps, usize::MAX, seed).map_err(on(gpu))
            }
            Err(ProbeError::Unavailable(why)) => {
                tracing::warn!(gpu, %why, "memory test falls back to the host read-back");
                memory_readback(&self.ctx(gpu)?, p).map_err(on(gpu))
            }
            Err(e) => Err(e),
        }
    }

    /// Every GPU's device-side test at once (`kernels::memtest_all`); a GPU whose kernels
    /// cannot load gets the host read-back, alone.
    pub(super) fn memtest_every(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
    ) -> Vec<(usize, Result<MemtestResult, ProbeError>)> {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5eed);
        let steps = kernels::steps(self.level, seed, std::time::Duration::from_secs(p.fade_secs.into()));
        let mut out = Vec::new();
        let mut with = Vec::new();
        for &g in gpus {
            match self.with_kernels(g) {
                Ok((ctx, _)) => with.push((g, ctx)),
                Err(ProbeError::Unavailable(why)) => {
                    tracing::warn!(gpu = g, %why, "memory test falls back to the host read-back");
                    out.push((g, self.ctx(g).and_then(|c| memory_readback(&c, p).map_err(on(g)))));
                }
                Err(e) => out.push((g, Err(e))),
            }
        }
        let loaded = &self.kernels;
        let mut runs: Vec<(usize, Result<kernels::Memtest<'_>, ProbeError>)> = with
            .iter()
            .map(|(g, ctx)| {
                let k = loaded.get(g).and_then(|x| x.as_ref().ok());
                let r = k
                    .ok_or_else(|| ProbeError::Unavailable("the probe kernels are not loaded".into()))
                    .and_then(|k| kernels::Memtest::new(ctx, k, usize::MAX, seed).map_err(on(*g)));
                (*g, r)
            })
            .collect();
        kernels::memtest_all(&mut runs, &steps, |g, e| on(g)(e));
        out.extend(runs.into_iter().map(|(g, r)| (g, r.and_then(|t| t.result().map_err(on(g))))));
        out.sort_by_key(|(g, _)| *g);
        out
    }
}
