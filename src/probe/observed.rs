//! A backend wrapper that reads NVML before and after each per-GPU measurement, so a throttled
//! GPU is told apart from a slow link, and a GPU another process used meanwhile from a slow one
//! (issue 51: a job that starts during a re-check must not read as lost hardware). It reads
//! through the `collect::nvml::Session` it is handed — only `collect` touches NVML — and never
//! opens one of its own.
//!
//! The look for another process (`look`): every compute process NVML lists on the GPU that is
//! neither this process nor a child of it (the all-reduce's), before and after each
//! measurement; and, at the first look at a GPU only, before any probe has run on it, a
//! utilisation above 0 % with no such process (NVML's utilisation covers its last sample
//! period, so later looks would see the probes' own work). What it finds is the GPU's
//! `contended_by`, and `judge::contended` makes that GPU's shortfalls `unknown`.

use super::backend::{Backend, Half};
use super::levels::LevelParams;
use super::results::{Contender, GemmResult, MemtestResult, PowerRun, ProbeError, Run};
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
    /// Other processes seen on each GPU (`look`).
    contended: std::collections::BTreeMap<usize, Vec<Contender>>,
    /// The GPUs looked at so far (the first look also weighs utilisation).
    looked: std::collections::BTreeSet<usize>,
    /// Where a contender's name and parent are read: the live machine's /proc.
    proc_root: crate::sysroot::Sysroot,
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
        Observed {
            inner,
            session,
            pcis,
            seen: Default::default(),
            power: Default::default(),
            contended: Default::default(),
            looked: Default::default(),
            proc_root: crate::sysroot::Sysroot::new("/"),
        }
    }

    /// NVML's reading of `gpu` now, with the other processes on it recorded (module comment).
    fn look(&mut self, gpu: usize, when: &str) -> Option<Conditions> {
        let (session, pci) = (self.session?, self.pcis.get(gpu)?);
        let c = match session.conditions(pci) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(gpu, error = %e, "no NVML reading beside the probe");
                return None;
            }
        };
        let own = std::process::id();
        let mut found: Vec<Contender> = Vec::new();
        for p in c.processes.iter().flatten().filter(|p| p.pid != own) {
            let who = crate::collect::procs::name_and_parent(&self.proc_root, p.pid);
            if who.as_ref().is_some_and(|(_, parent)| *parent == own) {
                continue; // the all-reduce's child: the probe's own
            }
            let what = match p.used_bytes {
                Some(b) => format!("{} MiB of GPU memory", b >> 20),
                None => "a compute context".to_string(),
            };
            found.push(Contender { pid: p.pid, name: who.map(|(n, _)| n), seen: when.to_string(), what });
        }
        let first = self.looked.insert(gpu);
        if let Some(u) = c.utilization_gpu.filter(|u| first && found.is_empty() && *u > 0) {
            let what = format!("{u} % utilisation with no other process listed");
            found.push(Contender { pid: 0, name: None, seen: when.to_string(), what });
        }
        let list = self.contended.entry(gpu).or_default();
        for f in found {
            if !list.iter().any(|x| x.pid == f.pid) {
                list.push(f);
            }
        }
        Some(c)
    }

    /// Looks at `gpus` before a measurement of `probe`.
    fn before(&mut self, gpus: &[usize], probe: &str) {
        for g in gpus {
            self.look(*g, &format!("before {probe}"));
        }
    }

    fn after<T>(&mut self, gpu: usize, probe: &str, r: Result<T, ProbeError>) -> Result<T, ProbeError> {
        if let Some(c) = self.look(gpu, &format!("after {probe}")) {
            self.seen.entry(gpu).or_default().insert(probe.to_string(), c);
        }
        r
    }
}

impl Backend for Observed<'_> {
    fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[gpu], "h2d");
        let r = self.inner.h2d(gpu, p);
        self.after(gpu, "h2d", r)
    }
    fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[gpu], "d2h");
        let r = self.inner.d2h(gpu, p);
        self.after(gpu, "d2h", r)
    }
    fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[gpu], "bidir");
        let r = self.inner.bidir(gpu, p);
        self.after(gpu, "bidir", r)
    }
    fn d2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[gpu], "d2d");
        let r = self.inner.d2d(gpu, p);
        self.after(gpu, "d2d", r)
    }
    fn can_access_peer(&mut self, src: usize, dst: usize) -> Result<bool, ProbeError> {
        self.inner.can_access_peer(src, dst)
    }
    fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[src, dst], "p2p");
        let r = self.inner.p2p(src, dst, p);
        self.before(&[src, dst], "p2p");
        r
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
        self.before(&[gpu], "gemm");
        let r = self.inner.gemm(gpu, p);
        self.after(gpu, "gemm", r)
    }
    fn gemm_tensor(&mut self, gpu: usize, p: &LevelParams, half: Half) -> Result<GemmResult, ProbeError> {
        self.before(&[gpu], "gemm_tensor");
        let r = self.inner.gemm_tensor(gpu, p, half);
        self.after(gpu, if half == Half::Fp16 { "gemm_tensor_fp16" } else { "gemm_tensor" }, r)
    }
    fn sm_copy(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[gpu], "sm_copy");
        let r = self.inner.sm_copy(gpu, p);
        self.after(gpu, "sm_copy", r)
    }
    fn gemm_sustained(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        secs: f64,
    ) -> Vec<(usize, Result<GemmResult, ProbeError>)> {
        self.before(gpus, "gemm_sustained");
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
        self.before(gpus, "gemm_fp64");
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
        self.before(&[gpu], "host_latency");
        let r = self.inner.host_latency(gpu, p);
        self.before(&[gpu], "host_latency");
        r
    }
    fn peer_latency(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
        self.before(&[src, dst], "peer_latency");
        let r = self.inner.peer_latency(src, dst, p);
        self.before(&[src, dst], "peer_latency");
        r
    }
    fn allreduce(
        &mut self,
        gpus: &[usize],
        p: &LevelParams,
        nvls: bool,
        limit: std::time::Duration,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Run, ProbeError> {
        self.before(gpus, "allreduce");
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
    fn contenders(&self, gpu: usize) -> Vec<Contender> {
        self.contended.get(&gpu).cloned().unwrap_or_default()
    }
}
