//! A backend wrapper that reads NVML after each per-GPU measurement, so a throttled GPU is told
//! apart from a slow link. It reads through the `collect::nvml::Session` it is handed — only
//! `collect` touches NVML — and never opens one of its own.

use super::backend::{Backend, Half};
use super::levels::LevelParams;
use super::results::{GemmResult, MemtestResult, PowerRun, ProbeError, Run};
use crate::collect::nvml::Session;
use crate::snapshot::Conditions;

/// A backend whose every per-GPU measurement is followed by an NVML reading of that GPU.
pub(super) struct Observed<'a> {
    inner: &'a mut dyn Backend,
    session: Option<&'a Session>,
    pcis: Vec<String>,
    seen: std::collections::BTreeMap<usize, std::collections::BTreeMap<String, Conditions>>,
    /// The boards' power while the last FP64 load ran, by GPU.
    power: std::collections::BTreeMap<usize, PowerRun>,
}

/// How often the power test reads every board: ten times a second, our choice — NVML's reading
/// is already a one-second average on Hopper (`nvmlDeviceGetPowerUsage`), so faster would read
/// the same value, and slower could miss the first seconds of a short run.
const POWER_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Readings of one board, folded as they come.
#[derive(Default)]
struct Readings {
    mw: Vec<u32>,
    limit_mw: Option<u32>,
    error: Option<String>,
}

impl Readings {
    fn run(self) -> PowerRun {
        let w: Vec<f64> = self.mw.iter().map(|m| f64::from(*m) / 1000.0).collect();
        PowerRun {
            samples: w.len() as u32,
            max_w: w.iter().copied().reduce(f64::max),
            avg_w: (!w.is_empty()).then(|| w.iter().sum::<f64>() / w.len() as f64),
            limit_w: self.limit_mw.map(|m| f64::from(m) / 1000.0),
            error: self.error,
        }
    }
}

/// Reads every board in `pcis` through `session` each `POWER_EVERY` until `stop`, and once more
/// after it (the GEMMs have just finished: NVML's one-second average still holds their load).
fn sample_power(session: &Session, pcis: &[String], stop: &std::sync::atomic::AtomicBool) -> Vec<Readings> {
    let mut out: Vec<Readings> = pcis.iter().map(|_| Readings::default()).collect();
    loop {
        let last = stop.load(std::sync::atomic::Ordering::Acquire);
        match session.powers(pcis) {
            Ok(each) => {
                for (r, got) in out.iter_mut().zip(each) {
                    match got {
                        Ok((mw, limit)) => {
                            r.mw.push(mw);
                            r.limit_mw = limit.or(r.limit_mw);
                        }
                        Err(e) => {
                            r.error.get_or_insert(e);
                        }
                    }
                }
            }
            Err(e) => {
                for r in out.iter_mut() {
                    r.error.get_or_insert(e.clone());
                }
                // NVML blocked or gone: another call would wait out the same deadline.
                return out;
            }
        }
        if last {
            return out;
        }
        std::thread::sleep(POWER_EVERY);
    }
}

impl<'a> Observed<'a> {
    /// `inner` read through `session` (none: the figures stand alone) after each measurement;
    /// `pcis` names each CUDA ordinal's GPU for NVML.
    pub(super) fn new(inner: &'a mut dyn Backend, session: Option<&'a Session>, pcis: Vec<String>) -> Self {
        Observed { inner, session, pcis, seen: Default::default(), power: Default::default() }
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
    /// The FP64 load with every board's power read beside it, on a thread of its own.
    fn gemm_fp64(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        let Some(session) = self.session else { return self.inner.gemm_fp64(gpus, p, secs) };
        let pcis: Vec<String> = gpus.iter().map(|g| self.pcis.get(*g).cloned().unwrap_or_default()).collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let inner = &mut *self.inner;
        let (out, readings) = std::thread::scope(|s| {
            let sampler = s.spawn(|| sample_power(session, &pcis, &stop));
            let out = inner.gemm_fp64(gpus, p, secs);
            stop.store(true, std::sync::atomic::Ordering::Release);
            (out, sampler.join().unwrap_or_default())
        });
        for (g, r) in gpus.iter().zip(readings) {
            self.power.insert(*g, r.run());
        }
        for g in gpus {
            let _ = self.after(*g, "gemm_fp64", Ok(()));
        }
        out
    }
    fn power(&self, gpu: usize) -> Option<PowerRun> {
        self.power.get(&gpu).cloned()
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
