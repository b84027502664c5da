//! The seam between deciding and measuring: `Backend` measures one GPU or pair, and its
//! defaults are honest — a measurement a backend does not have is `Unavailable` with the reason,
//! never a zero. The CUDA implementation is `cuda_backend.rs`; the unit tests' is `fake.rs`.

use super::levels::LevelParams;
use super::results::{GemmResult, MemtestResult, PowerRun, ProbeError, Run};
use crate::snapshot::Conditions;

/// The 16-bit inputs of the tensor-core GEMM (FP32 accumulation either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    Bf16,
    Fp16,
}

/// Measures one GPU or pair. Bandwidth methods return GB/s per sample.
pub trait Backend {
    fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError>;
    fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError>;
    /// Both directions at once; the sum of both.
    fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError>;
    /// Device-local copy, counting bytes read plus written.
    fn d2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError>;
    fn can_access_peer(&mut self, src: usize, dst: usize) -> Result<bool, ProbeError>;
    fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError>;
    fn memory_integrity(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError>;
    /// The memory test on all of `gpus` at once (a bit-fade pause is then one pause for all);
    /// by default one GPU after the other.
    fn memory_integrity_all(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
    ) -> Vec<(usize, Result<MemtestResult, ProbeError>)> {
        gpus.iter().map(|g| (*g, self.memory_integrity(*g, p))).collect()
    }
    fn gemm(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError>;
    /// A GEMM on the tensor cores (BF16 or FP16 in, FP32 accumulate), every entry checked.
    fn gemm_tensor(&mut self, _gpu: usize, _p: &LevelParams, _half: Half) -> Result<GemmResult, ProbeError> {
        Err(ProbeError::Unavailable("this backend has no tensor-core GEMM".into()))
    }
    /// Device-local copy by a kernel on the SMs, counting bytes read plus written.
    fn sm_copy(&mut self, _gpu: usize, _p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Err(ProbeError::Unavailable("this backend has no SM copy".into()))
    }
    /// Nanoseconds per dependent load of pinned host memory by a kernel on GPU `gpu`.
    fn host_latency(&mut self, _gpu: usize, _p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Err(ProbeError::Unavailable("this backend has no latency probe".into()))
    }
    /// GEMMs on all of `gpus` at once for `secs` seconds of GPU time each, every result checked.
    fn gemm_sustained(
        &mut self,
        gpus: &[usize],
        _p: &LevelParams,
        _secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        gpus.iter().map(|g| (*g, Err(ProbeError::Unavailable("this backend has no sustained GEMM".into())))).collect()
    }
    /// FP64 GEMMs on all of `gpus` at once for `secs` seconds of GPU time each, every result
    /// checked: the load of the power test.
    fn gemm_fp64(
        &mut self,
        gpus: &[usize],
        _p: &LevelParams,
        _secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        gpus.iter().map(|g| (*g, Err(ProbeError::Unavailable("this backend has no FP64 GEMM".into())))).collect()
    }
    /// The boards' power sampled while the last `gemm_fp64` ran, by GPU; none where nothing
    /// read it (no NVML beside the backend).
    fn power(&self, _gpu: usize) -> Option<PowerRun> {
        None
    }
    /// Nanoseconds per dependent load of GPU `dst`'s memory by a kernel on GPU `src` (peer
    /// access enabled by `p2p` before).
    fn peer_latency(&mut self, _src: usize, _dst: usize, _p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        Err(ProbeError::Unavailable("this backend has no latency probe".into()))
    }
    /// NCCL's all-reduce across `gpus` (CUDA ordinals), as NCCL chooses or with NVLS off, under
    /// `limit`.
    fn allreduce(
        &mut self,
        _gpus: &[usize],
        _p: &LevelParams,
        _nvls: bool,
        _limit: std::time::Duration,
        _progress: &mut dyn FnMut(&str),
    ) -> Result<Run, ProbeError> {
        Err(ProbeError::Unavailable("this backend has no all-reduce".into()))
    }
    /// Lets go of a GPU the run stops using (its context is poisoned).
    fn release(&mut self, _gpu: usize) {}
    /// Where GPU `gpu`'s pinned host buffers were placed (NUMA node), once it has some.
    fn host_placement(&self, _gpu: usize) -> Option<String> {
        None
    }
    /// What NVML read of GPU `gpu` after each of its measurements, by probe name.
    fn conditions(&self, _gpu: usize) -> std::collections::BTreeMap<String, Conditions> {
        Default::default()
    }
    /// Other processes seen on GPU `gpu` while it was probed (`observed`'s look).
    fn contenders(&self, _gpu: usize) -> Vec<super::results::Contender> {
        Vec::new()
    }
}
