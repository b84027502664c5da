//! The run loop: what to measure, in which order, on which GPUs and pairs, through a `Backend`.
//! Pure but for the backend it drives, so it is unit-tested without a GPU (`fake.rs`).
//!
//! Its rules:
//! 1. The order is fixed: each GPU's copies, then every GPU's memory test at once (bit-fade
//!    pauses waited once for all), each GPU's GEMMs, the all-GPU GEMM, the peer copies of every
//!    ordered pair, and NCCL's all-reduce last (it runs in child processes). — `run`.
//! 2. A sticky error poisons its GPU's context: the GPU is let go at once and never used again;
//!    its remaining probes and every pair it is part of are `unavailable`, so its peers' figures
//!    stand. One function does it, wherever the error comes from. — `Runner::retire`.
//! 3. An uncorrectable ECC error met by any probe of a GPU is its memory failure, even when it
//!    struck before the memory test ran (as DCGM counts it). — `Runner::memory_of`.

use super::allreduce;
use super::backend::{Backend, Half};
use super::budget;
use super::levels::{LevelParams, Options};
use super::results::{
    is_ecc, AllReduce, GpuProbes, MemtestResult, Outcome, PeerLink, ProbeError, ProbeReport, Run, Stat,
};
use super::scope;
use super::targets::{choose, Target};
use std::collections::BTreeMap;

/// Runs the probes `opts` asks for. `progress` hears each step as it starts.
///
/// A GPU whose context a sticky error poisoned is released at once and not used again: its
/// remaining probes and every pair it is part of are `unavailable`, so its peers' figures stand.
pub fn run(
    backend: &mut dyn Backend,
    targets: &[Target],
    opts: &Options<'_>,
    progress: &mut dyn FnMut(&str),
) -> ProbeReport {
    let p = opts.params();
    let (chosen, skipped) = choose(targets, opts);
    let chosen: Vec<&Target> = chosen.into_iter().map(|(t, _)| t).collect();
    let mut r = Runner { backend, poisoned: BTreeMap::new(), p, progress };
    let mut gpus: Vec<GpuProbes> = chosen.iter().map(|t| r.copies(t)).collect();
    // The memory test on every GPU at once: the GPUs work side by side, and the full level's
    // bit-fade pauses are waited once for all of them, not once per GPU.
    if !chosen.is_empty() {
        r.memory_tests(&chosen, &mut gpus);
    }
    r.gemms(&mut gpus);
    let secs = opts.gemm_seconds.unwrap_or(p.gemm_secs);
    if secs > 0 && !chosen.is_empty() {
        r.sustained_gemm(&chosen, &mut gpus, secs);
    }
    let secs = opts.power_seconds.unwrap_or(p.power_secs);
    if secs > 0 && !chosen.is_empty() {
        r.power_test(&chosen, &mut gpus, secs);
    }
    let mut peers = r.peer_copies(&chosen);
    scope::mark(&mut peers, targets);
    let mut report = ProbeReport { level: opts.level, params: p, gpus, peers, skipped, nvlink: None, allreduce: None };
    report.nvlink = Some(scope::nvlink_scope(&report, targets));
    report.allreduce = r.all_reduce(&chosen, opts);
    // Who else used each GPU, over the whole run (the peer copies and all-reduce included).
    for g in report.gpus.iter_mut() {
        g.contended_by = r.backend.contenders(g.ordinal);
    }
    report
}

fn bandwidth(r: Result<Vec<f64>, ProbeError>) -> Outcome<Stat> {
    match r {
        Ok(s) => Stat::of(s).map(Outcome::Ok).unwrap_or(Outcome::Error(ProbeError::Cuda("no valid sample".into()))),
        Err(e) => Outcome::Error(e),
    }
}

/// One run in progress: the backend, the level's sizes, and the GPUs a sticky error made
/// unusable so far, with why.
struct Runner<'r> {
    backend: &'r mut dyn Backend,
    poisoned: BTreeMap<usize, ProbeError>,
    p: LevelParams,
    progress: &'r mut dyn FnMut(&str),
}

impl Runner<'_> {
    fn say(&mut self, step: &str) {
        (self.progress)(step)
    }

    /// Rule 2, the one place a GPU is retired: a sticky error lets go of the GPU it poisoned
    /// and marks it unusable for the rest of the run.
    fn retire<T>(&mut self, r: &Result<T, ProbeError>) {
        if let Err(e @ ProbeError::Sticky { gpu, .. }) = r {
            self.backend.release(*gpu);
            self.poisoned.insert(*gpu, e.clone());
        }
    }

    /// Runs `f` unless a GPU in `gpus` is poisoned; a sticky error from `f` retires its GPU.
    fn call<T>(
        &mut self,
        gpus: &[usize],
        f: impl FnOnce(&mut dyn Backend) -> Result<T, ProbeError>,
    ) -> Result<T, ProbeError> {
        if let Some((g, why)) = gpus.iter().find_map(|g| self.poisoned.get(g).map(|w| (g, w))) {
            return Err(ProbeError::Unavailable(format!("not measured: GPU {g} is unusable since {why}")));
        }
        let r = f(&mut *self.backend);
        self.retire(&r);
        r
    }

    /// The chosen GPUs no sticky error has poisoned yet.
    fn live(&self, chosen: &[&Target]) -> Vec<usize> {
        chosen.iter().map(|t| t.ordinal).filter(|g| !self.poisoned.contains_key(g)).collect()
    }

    /// Rule 3: the memory verdict of GPU `g`.
    fn memory_of(&self, g: usize, tested: Outcome<MemtestResult>) -> Outcome<MemtestResult> {
        match (tested, self.poisoned.get(&g)) {
            (Outcome::Error(ProbeError::Unavailable(_)), Some(e)) if is_ecc(e) => Outcome::Error(e.clone()),
            (m, _) => m,
        }
    }

    /// A GPU's copies and latency, one after the other; its memory test and GEMMs are filled
    /// in later.
    fn copies(&mut self, t: &Target) -> GpuProbes {
        let (g, p) = (t.ordinal, self.p);
        let step = |what: &str| format!("GPU {g} ({}): {what}", t.pci);
        self.say(&step("host→device"));
        let h2d = bandwidth(self.call(&[g], |b| b.h2d(g, &p)));
        self.say(&step("device→host"));
        let d2h = bandwidth(self.call(&[g], |b| b.d2h(g, &p)));
        self.say(&step("bidirectional"));
        let bidir = bandwidth(self.call(&[g], |b| b.bidir(g, &p)));
        self.say(&step("device copy"));
        let d2d = bandwidth(self.call(&[g], |b| b.d2d(g, &p)));
        self.say(&step("SM copy"));
        let sm_copy = bandwidth(self.call(&[g], |b| b.sm_copy(g, &p)));
        self.say(&step("host latency"));
        let host_latency = bandwidth(self.call(&[g], |b| b.host_latency(g, &p)));
        // Filled in below: every GPU's memory test runs at once, then each GPU's GEMM.
        let memory = Outcome::Error(ProbeError::Unavailable("not measured".into()));
        let gemm = Outcome::Error(ProbeError::Unavailable("not measured".into()));
        GpuProbes {
            ordinal: g,
            pci: t.pci.clone(),
            h2d_gbps: h2d,
            d2h_gbps: d2h,
            bidir_gbps: bidir,
            d2d_gbps: d2d,
            memory,
            gemm,
            sm_copy_gbps: Some(sm_copy),
            host_latency_ns: Some(host_latency),
            gemm_sustained: None,
            gemm_fp64: None,
            power: None,
            gemm_tensor: None,
            gemm_tensor_fp16: None,
            host_memory: self.backend.host_placement(g),
            conditions: self.backend.conditions(g),
            contended_by: Vec::new(),
        }
    }

    /// Every live GPU's memory test at once (`chosen` is not empty).
    fn memory_tests(&mut self, chosen: &[&Target], gpus: &mut [GpuProbes]) {
        let live = self.live(chosen);
        match live.as_slice() {
            [g] => {
                let pci = chosen.iter().find(|t| t.ordinal == *g).map(|t| t.pci.as_str()).unwrap_or("");
                self.say(&format!("GPU {g} ({pci}): memory integrity"));
            }
            _ => self.say(&format!("GPUs {live:?} at once: memory integrity")),
        }
        let mut tested: BTreeMap<usize, Outcome<MemtestResult>> = Default::default();
        let p = self.p;
        for (g, r) in self.backend.memory_integrity_all(&live, &p) {
            self.retire(&r);
            tested.insert(g, r.into());
        }
        for gp in gpus.iter_mut() {
            let g = gp.ordinal;
            let m = tested.remove(&g).unwrap_or_else(|| {
                let why = self.poisoned.get(&g).map(|e| e.to_string()).unwrap_or_default();
                Outcome::Error(ProbeError::Unavailable(format!("not measured: GPU {g} is unusable since {why}")))
            });
            gp.memory = self.memory_of(g, m);
        }
    }

    /// Each GPU's GEMMs: FP32, then BF16 and FP16 on the tensor cores.
    fn gemms(&mut self, gpus: &mut [GpuProbes]) {
        let p = self.p;
        for gp in gpus.iter_mut() {
            let g = gp.ordinal;
            self.say(&format!("GPU {g} ({}): GEMM", gp.pci));
            gp.gemm = self.call(&[g], |b| b.gemm(g, &p)).into();
            self.say(&format!("GPU {g} ({}): tensor-core GEMM", gp.pci));
            gp.gemm_tensor = Some(self.call(&[g], |b| b.gemm_tensor(g, &p, Half::Bf16)).into());
            self.say(&format!("GPU {g} ({}): tensor-core GEMM, FP16", gp.pci));
            gp.gemm_tensor_fp16 = Some(self.call(&[g], |b| b.gemm_tensor(g, &p, Half::Fp16)).into());
            // NVML's readings beside the memory test and the GEMM, taken since the GPU's first loop.
            gp.conditions = self.backend.conditions(g);
        }
    }

    /// GEMMs on every live GPU at once for `secs` seconds each (`chosen` is not empty).
    fn sustained_gemm(&mut self, chosen: &[&Target], gpus: &mut [GpuProbes], secs: u32) {
        let live = self.live(chosen);
        self.say(&format!("GPUs {live:?} at once: GEMM for {secs} s each"));
        let p = self.p;
        for (g, r) in self.backend.gemm_sustained(&live, &p, secs.into()) {
            self.retire(&r);
            if let Some(gp) = gpus.iter_mut().find(|x| x.ordinal == g) {
                gp.gemm_sustained = Some(r.into());
            }
        }
        for gp in gpus.iter_mut() {
            gp.conditions = self.backend.conditions(gp.ordinal);
        }
    }

    /// FP64 GEMMs on every live GPU at once for `secs` seconds each, the boards' power sampled
    /// meanwhile (`chosen` is not empty).
    fn power_test(&mut self, chosen: &[&Target], gpus: &mut [GpuProbes], secs: u32) {
        let live = self.live(chosen);
        self.say(&format!("GPUs {live:?} at once: FP64 GEMM for {secs} s each, power sampled"));
        let p = self.p;
        for (g, r) in self.backend.gemm_fp64(&live, &p, secs.into()) {
            self.retire(&r);
            if let Some(gp) = gpus.iter_mut().find(|x| x.ordinal == g) {
                gp.gemm_fp64 = Some(r.into());
                gp.power = self.backend.power(g);
            }
        }
        for gp in gpus.iter_mut() {
            gp.conditions = self.backend.conditions(gp.ordinal);
        }
    }

    /// Every ordered pair of chosen GPUs: peer access, then its copies and latency. Scopes are
    /// `scope::mark`'s.
    fn peer_copies(&mut self, chosen: &[&Target]) -> Vec<PeerLink> {
        let p = self.p;
        let mut peers = Vec::new();
        for a in chosen {
            for b in chosen {
                let (src, dst) = (a.ordinal, b.ordinal);
                if src == dst {
                    continue;
                }
                self.say(&format!("GPU {src} → GPU {dst}: peer copy"));
                let link = match self.call(&[src, dst], |x| x.can_access_peer(src, dst)) {
                    Ok(true) => {
                        let bw = bandwidth(self.call(&[src, dst], |x| x.p2p(src, dst, &p)));
                        let lat = bandwidth(self.call(&[src, dst], |x| x.peer_latency(src, dst, &p)));
                        PeerLink {
                            src,
                            dst,
                            peer_access: true,
                            gbps: Some(bw),
                            latency_ns: Some(lat),
                            scope: String::new(),
                        }
                    }
                    Ok(false) => {
                        PeerLink { src, dst, peer_access: false, gbps: None, latency_ns: None, scope: "none".into() }
                    }
                    Err(e) => PeerLink {
                        src,
                        dst,
                        peer_access: false,
                        gbps: Some(Outcome::Error(e)),
                        latency_ns: None,
                        scope: "none".into(),
                    },
                };
                peers.push(link);
            }
        }
        peers
    }

    /// NCCL's all-reduce over the probed GPUs that are still usable, last (it runs in child
    /// processes, and the backend lets go of its contexts first): as NCCL chooses, then with NVLS
    /// off. `None` where the level runs none or fewer than two GPUs are left.
    fn all_reduce(&mut self, chosen: &[&Target], opts: &Options<'_>) -> Option<AllReduce> {
        let p = opts.params();
        let live: Vec<&Target> = chosen.iter().copied().filter(|t| !self.poisoned.contains_key(&t.ordinal)).collect();
        if p.allreduce_bytes == 0 || live.len() < 2 {
            return None;
        }
        let gpus: Vec<usize> = live.iter().map(|t| t.ordinal).collect();
        let floor = budget::allreduce_rate(&live);
        let limit = allreduce::deadline(&p, gpus.len(), floor, opts.nccl_allowance);
        let label = |what: &str, step: &str| format!("all-reduce ({what}): {step}");
        self.say(&format!("GPUs {gpus:?}: all-reduce as NCCL chooses"));
        let progress = &mut *self.progress;
        let nccl: Outcome<Run> =
            self.backend.allreduce(&gpus, &p, true, limit, &mut |s| progress(&label("as NCCL chooses", s))).into();
        // After a failure the second run would meet the same (or wait out the same deadline).
        let nvls_off = matches!(nccl, Outcome::Ok(_)).then(|| {
            progress(&format!("GPUs {gpus:?}: all-reduce with NVLS off"));
            self.backend.allreduce(&gpus, &p, false, limit, &mut |s| progress(&label("NVLS off", s))).into()
        });
        Some(AllReduce {
            gpus: live.iter().map(|t| t.pci.clone()).collect(),
            bytes: p.allreduce_bytes as u64,
            nccl,
            nvls_off,
            deadline_s: limit.as_secs(),
        })
    }
}
