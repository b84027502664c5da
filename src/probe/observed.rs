//! A backend wrapper that reads NVML after each per-GPU measurement, so a throttled GPU is told
//! apart from a slow link. It reads through the `collect::nvml::Session` it is handed — only
//! `collect` touches NVML — and never opens one of its own.

use super::backend::{Backend, Half};
use super::levels::LevelParams;
use super::results::{GemmResult, MemtestResult, ProbeError, Run};
use crate::collect::nvml::Session;
use crate::snapshot::Conditions;

/// A backend whose every per-GPU measurement is followed by an NVML reading of that GPU.
pub(super) struct Observed<'a> {
    inner: &'a mut dyn Backend,
    session: Option<&'a Session>,
    pcis: Vec<String>,
    seen: std::collections::BTreeMap<usize, std::collections::BTreeMap<String, Conditions>>,
}

impl<'a> Observed<'a> {
    /// `inner` read through `session` (none: the figures stand alone) after each measurement;
    /// `pcis` names each CUDA ordinal's GPU for NVML.
    pub(super) fn new(inner: &'a mut dyn Backend, session: Option<&'a Session>, pcis: Vec<String>) -> Self {
        Observed { inner, session, pcis, seen: Default::default() }
    }

    fn after<T>(&mut self, gpu: usize, probe: &str, r: Result<T, ProbeError>) -> Result<T, ProbeError> {
        if let (Some(s), Some(pci)) = (self.session, self.pcis.get(gpu)) {
            match s.conditions(pci) {
                Ok(c) => {
                    self.seen.entry(gpu).or_default().insert(probe.to_string(), c);
                }
                Err(e) => tracing::debug!(gpu, error = %e, "no NVML reading beside the probe"),
            }
        }
        r
    }
}

impl Backend for Observed<'_> {
    fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let r = self.inner.h2d(gpu, p);
        self.after(gpu, "h2d", r)
    }
    fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let r = self.inner.d2h(gpu, p);
        self.after(gpu, "d2h", r)
    }
    fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let r = self.inner.bidir(gpu, p);
        self.after(gpu, "bidir", r)
    }
    fn d2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let r = self.inner.d2d(gpu, p);
        self.after(gpu, "d2d", r)
    }
    fn can_access_peer(&mut self, src: usize, dst: usize) -> Result<bool, ProbeError> {
        self.inner.can_access_peer(src, dst)
    }
    fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.inner.p2p(src, dst, p)
    }
    /// NVML's counters are read before the memory test as well, so a rise across it shows.
    fn memory_integrity(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError> {
        let _ = self.after(gpu, "memory_before", Ok(()));
        let r = self.inner.memory_integrity(gpu, p);
        self.after(gpu, "memory", r)
    }
    fn memory_integrity_all(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
    ) -> Vec<(usize, Result<MemtestResult, ProbeError>)> {
        for g in gpus {
            let _ = self.after(*g, "memory_before", Ok(()));
        }
        let out = self.inner.memory_integrity_all(gpus, p);
        out.into_iter().map(|(g, r)| (g, self.after(g, "memory", r))).collect()
    }
    fn gemm(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError> {
        let r = self.inner.gemm(gpu, p);
        self.after(gpu, "gemm", r)
    }
    fn gemm_tensor(&mut self, gpu: usize, p: &LevelParams, half: Half) -> Result<GemmResult, ProbeError> {
        let r = self.inner.gemm_tensor(gpu, p, half);
        self.after(gpu, if half == Half::Fp16 { "gemm_tensor_fp16" } else { "gemm_tensor" }, r)
    }
    fn sm_copy(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        let r = self.inner.sm_copy(gpu, p);
        self.after(gpu, "sm_copy", r)
    }
    fn gemm_sustained(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        let out = self.inner.gemm_sustained(gpus, p, secs);
        for g in gpus {
            let _ = self.after(*g, "gemm_sustained", Ok(()));
        }
        out
    }
    fn host_latency(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.inner.host_latency(gpu, p)
    }
    fn peer_latency(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.inner.peer_latency(src, dst, p)
    }
    fn allreduce(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        nvls: bool,
        limit: std::time::Duration,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Run, ProbeError> {
        let r = self.inner.allreduce(gpus, p, nvls, limit, progress);
        let probe = if nvls { "allreduce" } else { "allreduce_nvls_off" };
        gpus.iter().fold(r, |r, g| self.after(*g, probe, r))
    }
    fn release(&mut self, gpu: usize) {
        self.inner.release(gpu)
    }
    fn host_placement(&self, gpu: usize) -> Option<String> {
        self.inner.host_placement(gpu)
    }
    fn conditions(&self, gpu: usize) -> std::collections::BTreeMap<String, Conditions> {
        self.seen.get(&gpu).cloned().unwrap_or_default()
    }
}
