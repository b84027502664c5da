//! probe: what a tenant will get from each GPU, measured through CUDA, judged against per-SKU
//! floors (`facts::probe_floors`).
//!
//! The seam: `Backend` does the measuring (the CUDA implementation in `cuda.rs`; a small
//! simulated GPU in the tests); `run` decides what to measure, on which GPUs and pairs, and
//! never touches a GPU with compute processes unless forced; `judge` turns the report into
//! `probe.*` findings. Everything but the backend is pure and unit-tested without a GPU.
//!
//! Method (nvbandwidth's): large buffers, many copies queued per sample and timed with CUDA
//! events, several samples, the median reported.

pub mod affinity;
pub mod allreduce;
pub mod baseline;
pub mod child;
pub mod cuda;
pub mod judge;
pub mod kernels;
pub mod lock;
pub mod plan;

use crate::checks::Finding;
use crate::config::ProbeLevel;
use crate::snapshot::Conditions;
pub use judge::{judge, judge_here, unavailable, GEMM_TOLERANCE};
use serde::{Deserialize, Serialize};

/// How much a level measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LevelParams {
    pub buffer_bytes: usize,
    pub copies_per_sample: u32,
    pub samples: u32,
    /// Bytes of device memory the host read-back memory test covers, the fallback when the
    /// probe kernels cannot load (the kernels' test covers 90% of free memory at every level).
    pub memtest_bytes: usize,
    /// Seconds the full level's bit-fade passes leave each pattern alone before checking it.
    #[serde(default)]
    pub fade_secs: u32,
    /// Seconds of GEMM on every probed GPU at once (0: none), checked as the single GEMM is.
    #[serde(default)]
    pub gemm_secs: u32,
    /// Square GEMM size.
    pub gemm_n: usize,
    pub gemm_reps: u32,
    /// NCCL all-reduce message per GPU (0: no all-reduce at this level).
    #[serde(default)]
    pub allreduce_bytes: usize,
    /// Samples of `allreduce::ITERS` all-reduces each.
    #[serde(default)]
    pub allreduce_samples: u32,
}

pub fn params(level: ProbeLevel) -> LevelParams {
    const MIB: usize = 1 << 20;
    match level {
        // quick: well under 30 s for 8 GPUs (≈ 1.5 GiB of copies per direction per GPU).
        ProbeLevel::None | ProbeLevel::Quick => LevelParams {
            buffer_bytes: 64 * MIB,
            copies_per_sample: 8,
            samples: 3,
            memtest_bytes: 1024 * MIB,
            fade_secs: 0,
            gemm_secs: 0,
            gemm_n: 4096,
            gemm_reps: 5,
            // None: NCCL's start alone (topology search, a connection per pair) takes seconds.
            allreduce_bytes: 0,
            allreduce_samples: 0,
        },
        // standard and full: nvbandwidth's 512 MiB buffers and 16 copies per sample.
        ProbeLevel::Standard => LevelParams {
            buffer_bytes: 512 * MIB,
            copies_per_sample: 16,
            samples: 5,
            memtest_bytes: 8192 * MIB,
            fade_secs: 0,
            gemm_secs: 0,
            gemm_n: 8192,
            gemm_reps: 10,
            // 1 GiB: our choice, large enough for NVLS and the rings to reach their plateau
            // (nccl-tests' sweeps level off from a few hundred MiB on NVSwitch systems).
            allreduce_bytes: 1024 * MIB,
            allreduce_samples: 3,
        },
        ProbeLevel::Full => LevelParams {
            buffer_bytes: 512 * MIB,
            copies_per_sample: 16,
            samples: 11,
            memtest_bytes: 64 * 1024 * MIB,
            // Our choice: long enough for a leaking cell to lose a charge it should hold for
            // the 32–64 ms between refreshes many times over, short enough that 8 GPUs tested
            // one after another stay within minutes.
            fade_secs: 20,
            // A minute of every GPU at full load: long enough for clocks to settle under the
            // power and thermal limits a node reaches only with all its GPUs busy.
            gemm_secs: 60,
            gemm_n: 16384,
            gemm_reps: 10,
            // 16 GiB, the message Azure's NCCL health check runs (azurehpc-health-checks,
            // `check_nccl_allreduce … 16G` in its ND H100 v5 and ND H200 v5 configurations).
            allreduce_bytes: 16 * 1024 * MIB,
            allreduce_samples: 3,
        },
    }
}

/// A GPU the probes may run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// CUDA ordinal (PCI order: the probes set `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub ordinal: usize,
    pub pci: String,
    pub device_id: Option<u16>,
    /// Compute processes NVML lists on it (never the agent's own).
    pub busy_pids: Vec<u32>,
    /// Why no context may be made on it at all (MIG mode, compute mode Prohibited).
    pub unusable: Option<String>,
    /// Active NVLinks NVML reports on it.
    pub nvlinks_active: usize,
    /// Whether NVML reported link states at all.
    pub nvlinks_known: bool,
    /// The GPUs (PCI addresses) NVML says this one reaches over NVLink (`nvmlDeviceGetP2PStatus`,
    /// NVLink capability), when NVML answered.
    pub nvlink_peers: Option<Vec<String>>,
    /// NVML's serial number of the board (else its UUID): the key of its baseline.
    pub serial: Option<String>,
    /// The PCI address each active NVLink leads to (an NVSwitch, or a bridged GPU).
    pub nvlink_remotes: Vec<String>,
    /// NVML's fabric state and clique, when it reports one ("completed, clique 1").
    pub fabric: Option<String>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum ProbeError {
    /// The measurement cannot run here (no cuBLAS for the GEMM, …): `unknown`, not a failure.
    #[error("{0}")]
    Unavailable(String),
    /// CUDA failed while measuring.
    #[error("{0}")]
    Cuda(String),
    /// A sticky error (uncorrectable ECC, illegal address) poisoned GPU `gpu`'s context: the
    /// GPU is unusable until reset, and the run stops using it.
    #[error("{message}")]
    Sticky { gpu: usize, code: i32, message: String },
    /// A measurement in a child process (NCCL's) did not finish within its deadline and was
    /// killed during `step`.
    #[error("did not finish within its {deadline_s} s deadline, blocked at: {step}")]
    Hung { step: String, deadline_s: u64 },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemtestResult {
    pub bytes_tested: u64,
    pub patterns: Vec<String>,
    pub mismatches: u64,
    /// Where the first mismatching word was (its device address with the kernels, its byte
    /// offset with the host read-back), and what was read there.
    pub first_mismatch: Option<(u64, String)>,
    /// `kernels` (the device-side test) or `host read-back` (the fallback).
    #[serde(default)]
    pub method: String,
    /// Allocations the tested memory came in.
    #[serde(default)]
    pub chunks: usize,
    /// The random pattern's seed (a new one each run).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Each check pass: its pattern and what it found.
    #[serde(default)]
    pub passes: Vec<MemtestPass>,
    /// GPU time the whole test took (bit-fade pauses included), by CUDA events.
    #[serde(default)]
    pub seconds: Option<f64>,
    /// The device addresses tested, `[start, end)`, neighbouring chunks merged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<[u64; 2]>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemtestPass {
    pub name: String,
    pub mismatches: u64,
    /// The first (up to 8) mismatches the GPU recorded.
    pub first: Vec<Mismatch>,
}

/// A 64-bit word that read back wrong: its device address, what was read, what was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    pub address: u64,
    pub read: u64,
    pub expected: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmResult {
    pub n: usize,
    pub tflops_samples: Vec<f64>,
    /// Largest relative difference between the GPU's result and the host reference on the
    /// checked entries.
    pub max_rel_error: f64,
    pub checked_entries: usize,
    /// Checked entries that differ from the exact product.
    #[serde(default)]
    pub wrong_entries: u64,
    pub library: String,
    /// `device` (every entry, by the check kernel) or `host` (scattered entries read back).
    #[serde(default)]
    pub checked_on: String,
    /// The first wrong entry: where, what it was, what it should be.
    #[serde(default)]
    pub first_wrong: Option<String>,
    /// GPU time the timed products took, seconds.
    #[serde(default)]
    pub seconds: f64,
}

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
    ) -> Result<allreduce::Run, ProbeError> {
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
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub samples: Vec<f64>,
    pub median: f64,
}

impl Stat {
    pub fn of(samples: Vec<f64>) -> Option<Stat> {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let mid = sorted.len() / 2;
        let median = if sorted.len() % 2 == 1 { sorted[mid] } else { (sorted[mid - 1] + sorted[mid]) / 2.0 };
        Some(Stat { samples, median })
    }
}

/// A measurement: its figures, or why there are none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome<T> {
    Ok(T),
    Error(ProbeError),
}

impl<T> From<Result<T, ProbeError>> for Outcome<T> {
    fn from(r: Result<T, ProbeError>) -> Self {
        match r {
            Ok(v) => Outcome::Ok(v),
            Err(e) => Outcome::Error(e),
        }
    }
}

fn bandwidth(r: Result<Vec<f64>, ProbeError>) -> Outcome<Stat> {
    match r {
        Ok(s) => Stat::of(s).map(Outcome::Ok).unwrap_or(Outcome::Error(ProbeError::Cuda("no valid sample".into()))),
        Err(e) => Outcome::Error(e),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuProbes {
    pub ordinal: usize,
    pub pci: String,
    pub h2d_gbps: Outcome<Stat>,
    pub d2h_gbps: Outcome<Stat>,
    pub bidir_gbps: Outcome<Stat>,
    pub d2d_gbps: Outcome<Stat>,
    pub memory: Outcome<MemtestResult>,
    pub gemm: Outcome<GemmResult>,
    /// HBM bandwidth through a copy kernel on the SMs (read + written), beside the copy
    /// engines' `d2d_gbps`.
    #[serde(default)]
    pub sm_copy_gbps: Option<Outcome<Stat>>,
    /// Nanoseconds per dependent load of pinned host memory from a kernel on the GPU.
    #[serde(default)]
    pub host_latency_ns: Option<Outcome<Stat>>,
    /// The GEMM run on every probed GPU at once (the full level), when it ran.
    #[serde(default)]
    pub gemm_sustained: Option<Outcome<GemmResult>>,
    /// BF16 on the tensor cores, checked exactly like the FP32 GEMM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_tensor: Option<Outcome<GemmResult>>,
    /// The same with FP16 inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_tensor_fp16: Option<Outcome<GemmResult>>,
    /// Where the pinned host buffers were placed (NUMA node and CPUs, or why not).
    #[serde(default)]
    pub host_memory: Option<String>,
    /// NVML's reading of the GPU right after each measurement (`h2d`, `d2h`, `bidir`, `d2d`,
    /// `memory`, `gemm`), so a throttled GPU is told apart from a slow link.
    #[serde(default)]
    pub conditions: std::collections::BTreeMap<String, Conditions>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerLink {
    pub src: usize,
    pub dst: usize,
    pub peer_access: bool,
    pub gbps: Option<Outcome<Stat>>,
    /// Nanoseconds per dependent load of `dst`'s memory from a kernel on `src`.
    #[serde(default)]
    pub latency_ns: Option<Outcome<Stat>>,
    /// `nvlink` when NVML reports active NVLinks on both GPUs (without NVML link states: when
    /// the pair copies faster than PCIe can, over 100 GB/s), `pcie` for other pairs with peer
    /// access, `none` without. A degraded NVLink is a slow `nvlink` pair, judged against the
    /// NVLink floor, never mistaken for a PCIe pair.
    pub scope: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    pub pci: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeReport {
    pub level: ProbeLevel,
    pub params: LevelParams,
    pub gpus: Vec<GpuProbes>,
    pub peers: Vec<PeerLink>,
    pub skipped: Vec<Skipped>,
    /// Which probed GPUs reach which over NVLink, and how.
    #[serde(default)]
    pub nvlink: Option<NvlinkScope>,
    /// NCCL's all-reduce across the probed GPUs, at the levels that run it with two or more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allreduce: Option<allreduce::AllReduce>,
}

/// The VM's NVLink scope: what NVML says links the probed GPUs, and what the peer copies found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NvlinkScope {
    pub gpus: usize,
    /// Ordered pairs of probed GPUs.
    pub pairs: usize,
    /// Ordered pairs that NVML (or, without NVML link data, the copy rate) puts on NVLink.
    pub nvlink_pairs: usize,
    /// Active NVLinks per GPU (PCI address).
    pub links: std::collections::BTreeMap<String, usize>,
    /// What the links lead to: `NVSwitch` (to devices that are none of the GPUs), `direct`
    /// (GPU to GPU bridges), `mixed`, or `unknown` (NVML gave no remote addresses).
    pub through: String,
    /// NVML's fabric state and clique per GPU, when reported.
    pub fabric: std::collections::BTreeMap<String, String>,
    /// Every measured pair: GPU indices, its scope, GB/s each way (`None` where not measured).
    #[serde(default)]
    pub pairs_gbps: Vec<PairFigures>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairFigures {
    pub a: usize,
    pub b: usize,
    pub scope: String,
    pub a_to_b: Option<f64>,
    pub b_to_a: Option<f64>,
}

fn nvlink_scope(report: &ProbeReport, targets: &[Target]) -> NvlinkScope {
    let probed: Vec<&Target> = report.gpus.iter().filter_map(|g| targets.iter().find(|t| t.pci == g.pci)).collect();
    let gpu_pcis: Vec<&str> = probed.iter().map(|t| t.pci.as_str()).collect();
    let remotes: Vec<&String> = probed.iter().flat_map(|t| &t.nvlink_remotes).collect();
    let to_gpu = remotes.iter().filter(|r| gpu_pcis.contains(&r.as_str())).count();
    let through = match (remotes.len(), to_gpu) {
        (0, _) => "unknown",
        (_, 0) => "NVSwitch",
        (n, k) if n == k => "direct",
        _ => "mixed",
    };
    NvlinkScope {
        gpus: probed.len(),
        pairs: report.peers.len(),
        nvlink_pairs: report.peers.iter().filter(|l| l.scope == "nvlink").count(),
        links: probed.iter().map(|t| (t.pci.clone(), t.nvlinks_active)).collect(),
        through: through.into(),
        fabric: probed.iter().filter_map(|t| Some((t.pci.clone(), t.fabric.clone()?))).collect(),
        pairs_gbps: {
            let rate = |src: usize, dst: usize| {
                report.peers.iter().find(|l| l.src == src && l.dst == dst).and_then(|l| match &l.gbps {
                    Some(Outcome::Ok(s)) => Some(s.median),
                    _ => None,
                })
            };
            report
                .peers
                .iter()
                .filter(|l| l.src < l.dst)
                .map(|l| PairFigures {
                    a: l.src,
                    b: l.dst,
                    scope: l.scope.clone(),
                    a_to_b: rate(l.src, l.dst),
                    b_to_a: rate(l.dst, l.src),
                })
                .collect()
        },
    }
}

/// Peer copies faster than this cannot have gone over PCIe Gen5 x16 (≈ 64 GB/s raw).
const NVLINK_SCOPE_GBPS: f64 = 100.0;

pub struct Options<'a> {
    pub level: ProbeLevel,
    /// Only these GPUs, by position in PCI bus order as nvidia-smi numbers them (empty: all).
    pub only: &'a [usize],
    /// Run on GPUs with compute processes too.
    pub force: bool,
    /// Seconds of the all-GPU GEMM instead of the level's (`--gemm-seconds`; 0: none).
    pub gemm_seconds: Option<u32>,
    /// The all-reduce's message per GPU instead of the level's (`--allreduce-size`; 0: none).
    pub allreduce_bytes: Option<usize>,
    /// Time allowed for NCCL's start in each all-reduce, beyond twice its planned transfers
    /// (`[probes] nccl_allowance`).
    pub nccl_allowance: std::time::Duration,
}

impl Options<'static> {
    /// Every GPU at `level`, nothing changed: no busy GPU forced, the level's GEMM time and
    /// all-reduce message, the default allowance for NCCL's start.
    pub fn at(level: ProbeLevel) -> Options<'static> {
        Options {
            level,
            only: &[],
            force: false,
            gemm_seconds: None,
            allreduce_bytes: None,
            nccl_allowance: crate::config::NCCL_ALLOWANCE,
        }
    }
}

impl Options<'_> {
    /// The level's sizes with what the options change: a message size given runs the
    /// all-reduce at any level (with the standard level's samples where the level has none).
    pub fn params(&self) -> LevelParams {
        let mut p = params(self.level);
        if let Some(b) = self.allreduce_bytes {
            p.allreduce_bytes = b;
            p.allreduce_samples = p.allreduce_samples.max(params(ProbeLevel::Standard).allreduce_samples);
        }
        p
    }
}

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
    let mut report = ProbeReport {
        level: opts.level,
        params: p,
        gpus: Vec::new(),
        peers: Vec::new(),
        skipped: Vec::new(),
        nvlink: None,
        allreduce: None,
    };
    let (chosen, skipped) = choose(targets, opts);
    report.skipped = skipped;
    let chosen: Vec<&Target> = chosen.into_iter().map(|(t, _)| t).collect();
    let mut guard = Poisoned::default();
    for t in &chosen {
        let g = t.ordinal;
        let mut step = |what: &str| progress(&format!("GPU {g} ({}): {what}", t.pci));
        step("host→device");
        let h2d = bandwidth(guard.call(backend, &[g], |b| b.h2d(g, &p)));
        step("device→host");
        let d2h = bandwidth(guard.call(backend, &[g], |b| b.d2h(g, &p)));
        step("bidirectional");
        let bidir = bandwidth(guard.call(backend, &[g], |b| b.bidir(g, &p)));
        step("device copy");
        let d2d = bandwidth(guard.call(backend, &[g], |b| b.d2d(g, &p)));
        step("SM copy");
        let sm_copy = bandwidth(guard.call(backend, &[g], |b| b.sm_copy(g, &p)));
        step("host latency");
        let host_latency = bandwidth(guard.call(backend, &[g], |b| b.host_latency(g, &p)));
        // Filled in below: every GPU's memory test runs at once, then each GPU's GEMM.
        let memory = Outcome::Error(ProbeError::Unavailable("not measured".into()));
        let gemm = Outcome::Error(ProbeError::Unavailable("not measured".into()));
        report.gpus.push(GpuProbes {
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
            gemm_tensor: None,
            gemm_tensor_fp16: None,
            host_memory: backend.host_placement(g),
            conditions: backend.conditions(g),
        });
    }
    // The memory test on every GPU at once: the GPUs work side by side, and the full level's
    // bit-fade pauses are waited once for all of them, not once per GPU.
    if !chosen.is_empty() {
        let live: Vec<usize> = chosen.iter().map(|t| t.ordinal).filter(|g| !guard.0.contains_key(g)).collect();
        match live.as_slice() {
            [g] => {
                let pci = chosen.iter().find(|t| t.ordinal == *g).map(|t| t.pci.as_str()).unwrap_or("");
                progress(&format!("GPU {g} ({pci}): memory integrity"));
            }
            _ => progress(&format!("GPUs {live:?} at once: memory integrity")),
        }
        let mut tested: std::collections::BTreeMap<usize, Outcome<MemtestResult>> = Default::default();
        for (g, r) in backend.memory_integrity_all(&live, &p) {
            if let Err(e @ ProbeError::Sticky { gpu, .. }) = &r {
                backend.release(*gpu);
                guard.0.insert(*gpu, e.clone());
            }
            tested.insert(g, r.into());
        }
        for gp in report.gpus.iter_mut() {
            let g = gp.ordinal;
            let m = tested.remove(&g).unwrap_or_else(|| {
                let why = guard.0.get(&g).map(|e| e.to_string()).unwrap_or_default();
                Outcome::Error(ProbeError::Unavailable(format!("not measured: GPU {g} is unusable since {why}")))
            });
            gp.memory = guard.memory_of(g, m);
        }
    }
    for gp in report.gpus.iter_mut() {
        let g = gp.ordinal;
        progress(&format!("GPU {g} ({}): GEMM", gp.pci));
        gp.gemm = guard.call(backend, &[g], |b| b.gemm(g, &p)).into();
        progress(&format!("GPU {g} ({}): tensor-core GEMM", gp.pci));
        gp.gemm_tensor = Some(guard.call(backend, &[g], |b| b.gemm_tensor(g, &p, Half::Bf16)).into());
        progress(&format!("GPU {g} ({}): tensor-core GEMM, FP16", gp.pci));
        gp.gemm_tensor_fp16 = Some(guard.call(backend, &[g], |b| b.gemm_tensor(g, &p, Half::Fp16)).into());
        // NVML's readings beside the memory test and the GEMM, taken since the GPU's first loop.
        gp.conditions = backend.conditions(g);
    }
    let secs = opts.gemm_seconds.unwrap_or(p.gemm_secs);
    if secs > 0 && !chosen.is_empty() {
        let live: Vec<usize> = chosen.iter().map(|t| t.ordinal).filter(|g| !guard.0.contains_key(g)).collect();
        progress(&format!("GPUs {live:?} at once: GEMM for {secs} s each"));
        for (g, r) in backend.gemm_sustained(&live, &p, secs.into()) {
            if let Err(e @ ProbeError::Sticky { gpu, .. }) = &r {
                backend.release(*gpu);
                guard.0.insert(*gpu, e.clone());
            }
            if let Some(gp) = report.gpus.iter_mut().find(|x| x.ordinal == g) {
                gp.gemm_sustained = Some(r.into());
            }
        }
        for gp in report.gpus.iter_mut() {
            gp.conditions = backend.conditions(gp.ordinal);
        }
    }
    for a in &chosen {
        for b in &chosen {
            let (src, dst) = (a.ordinal, b.ordinal);
            if src == dst {
                continue;
            }
            progress(&format!("GPU {src} → GPU {dst}: peer copy"));
            let link = match guard.call(backend, &[src, dst], |x| x.can_access_peer(src, dst)) {
                Ok(true) => {
                    let bw = bandwidth(guard.call(backend, &[src, dst], |x| x.p2p(src, dst, &p)));
                    let lat = bandwidth(guard.call(backend, &[src, dst], |x| x.peer_latency(src, dst, &p)));
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
            report.peers.push(link);
        }
    }
    for l in report.peers.iter_mut().filter(|l| l.peer_access) {
        let target = |o: usize| targets.iter().find(|t| t.ordinal == o);
        // NVML's own answer for the pair first; without it, active NVLinks on both GPUs.
        let nvml_says = target(l.src)
            .and_then(|a| Some((a.nvlink_peers.as_ref()?, target(l.dst)?)))
            .map(|(peers, b)| peers.contains(&b.pci));
        let links_on = |o: usize| target(o).is_some_and(|t| t.nvlinks_active > 0);
        let nvlink = nvml_says.unwrap_or_else(|| links_on(l.src) && links_on(l.dst));
        l.scope = match (&l.gbps, nvlink) {
            (_, true) => "nvlink",
            // No NVML link state (an old driver, a fixture): judge by throughput.
            (Some(Outcome::Ok(s)), false) if s.median >= NVLINK_SCOPE_GBPS && !nvml_knows_links(targets) => "nvlink",
            _ => "pcie",
        }
        .into();
    }
    report.nvlink = Some(nvlink_scope(&report, targets));
    report.allreduce = all_reduce(backend, &chosen, &guard, opts, progress);
    report
}

/// NCCL's all-reduce over the probed GPUs that are still usable, last (it runs in child
/// processes, and the backend lets go of its contexts first): as NCCL chooses, then with NVLS
/// off. `None` where the level runs none or fewer than two GPUs are left.
fn all_reduce(
    backend: &mut dyn Backend,
    chosen: &[&Target],
    guard: &Poisoned,
    opts: &Options<'_>,
    progress: &mut dyn FnMut(&str),
) -> Option<allreduce::AllReduce> {
    let p = opts.params();
    let live: Vec<&Target> = chosen.iter().copied().filter(|t| !guard.0.contains_key(&t.ordinal)).collect();
    if p.allreduce_bytes == 0 || live.len() < 2 {
        return None;
    }
    let gpus: Vec<usize> = live.iter().map(|t| t.ordinal).collect();
    let floor = plan::allreduce_rate(&live);
    let limit = allreduce::deadline(&p, gpus.len(), floor, opts.nccl_allowance);
    let label = |what: &str, step: &str| format!("all-reduce ({what}): {step}");
    progress(&format!("GPUs {gpus:?}: all-reduce as NCCL chooses"));
    let nccl: Outcome<allreduce::Run> =
        backend.allreduce(&gpus, &p, true, limit, &mut |s| progress(&label("as NCCL chooses", s))).into();
    // After a failure the second run would meet the same (or wait out the same deadline).
    let nvls_off = matches!(nccl, Outcome::Ok(_)).then(|| {
        progress(&format!("GPUs {gpus:?}: all-reduce with NVLS off"));
        backend.allreduce(&gpus, &p, false, limit, &mut |s| progress(&label("NVLS off", s))).into()
    });
    Some(allreduce::AllReduce {
        gpus: live.iter().map(|t| t.pci.clone()).collect(),
        bytes: p.allreduce_bytes as u64,
        nccl,
        nvls_off,
        deadline_s: limit.as_secs(),
    })
}

/// The targets a run probes, each with its index as nvidia-smi numbers it, and the ones it
/// leaves alone with the reason: not asked for, MIG or Prohibited, or busy without `force`.
pub fn choose<'t>(targets: &'t [Target], opts: &Options<'_>) -> (Vec<(&'t Target, usize)>, Vec<Skipped>) {
    // `--gpu N` is nvidia-smi's GPU N: the Nth in PCI bus order (CUDA programming guide,
    // CUDA_DEVICE_ORDER=PCI_BUS_ID "orders devices by PCI bus ID in ascending order"), even
    // when the user's environment asked CUDA for another order.
    let mut by_pci: Vec<&str> = targets.iter().map(|t| t.pci.as_str()).collect();
    by_pci.sort_unstable();
    let (mut chosen, mut skipped) = (Vec::new(), Vec::new());
    for t in targets {
        let index = by_pci.iter().position(|p| *p == t.pci).unwrap_or(t.ordinal);
        if !opts.only.is_empty() && !opts.only.contains(&index) {
            continue;
        }
        if let Some(why) = &t.unusable {
            skipped.push(Skipped { pci: t.pci.clone(), reason: why.clone() });
        } else if !t.busy_pids.is_empty() && !opts.force {
            let pids: Vec<String> = t.busy_pids.iter().map(|p| p.to_string()).collect();
            skipped.push(Skipped { pci: t.pci.clone(), reason: format!("{} compute process(es) run on it (pid {}); a probe never takes GPU time from a job (--force to run anyway)", pids.len(), pids.join(", ")) });
        } else {
            chosen.push((t, index));
        }
    }
    (chosen, skipped)
}

/// The GPUs a sticky error made unusable during a run, and why.
#[derive(Default)]
struct Poisoned(std::collections::BTreeMap<usize, ProbeError>);

impl Poisoned {
    /// Runs `f` unless a GPU in `gpus` is poisoned; a sticky error from `f` poisons its GPU and
    /// lets go of it.
    fn call<T>(
        &mut self,
        backend: &mut dyn Backend,
        gpus: &[usize],
        f: impl FnOnce(&mut dyn Backend) -> Result<T, ProbeError>,
    ) -> Result<T, ProbeError> {
        if let Some((g, why)) = gpus.iter().find_map(|g| self.0.get(g).map(|w| (g, w))) {
            return Err(ProbeError::Unavailable(format!("not measured: GPU {g} is unusable since {why}")));
        }
        let r = f(backend);
        if let Err(e @ ProbeError::Sticky { gpu, .. }) = &r {
            backend.release(*gpu);
            self.0.insert(*gpu, e.clone());
        }
        r
    }

    /// The memory verdict of GPU `g`: an uncorrectable ECC error met by any of its probes is a
    /// memory failure (as DCGM counts it) even when it struck before the memory test ran.
    fn memory_of(&self, g: usize, tested: Outcome<MemtestResult>) -> Outcome<MemtestResult> {
        match (tested, self.0.get(&g)) {
            (Outcome::Error(ProbeError::Unavailable(_)), Some(e)) if is_ecc(e) => Outcome::Error(e.clone()),
            (m, _) => m,
        }
    }
}

/// Whether `e` is CUDA's uncorrectable ECC error (214).
pub(crate) fn is_ecc(e: &ProbeError) -> bool {
    matches!(e, ProbeError::Sticky { code: crate::cuda::code::ECC_UNCORRECTABLE, .. })
}

/// Whether NVML reported link states for any target (else scope falls back to throughput).
fn nvml_knows_links(targets: &[Target]) -> bool {
    targets.iter().any(|t| t.nvlinks_known)
}

/// Why probes could not run here.
#[derive(Debug, thiserror::Error)]
pub enum NotRun {
    #[error(transparent)]
    Cuda(#[from] cuda::Unavailable),
    #[error(transparent)]
    Busy(#[from] lock::Held),
}

/// Probes the GPUs of this machine: CUDA for the measuring, the snapshot for each GPU's SKU, its
/// NVLinks and the compute processes that keep a probe off a GPU. Holds the run lock in
/// `state_dir` for `who` throughout.
pub fn run_here(
    snapshot: &crate::snapshot::Snapshot,
    opts: &Options<'_>,
    state_dir: &std::path::Path,
    who: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(ProbeReport, Vec<Target>), NotRun> {
    let _lock = lock::acquire(state_dir, who)?;
    let (mut backend, devices) = cuda::CudaBackend::open()?;
    backend.level = opts.level;
    let targets = targets_of(snapshot, &devices, std::process::id());
    // NVML beside CUDA, for the clocks after each measurement; without it the figures stand alone.
    let session = snapshot.nvml().map(|n| crate::collect::nvml::Session::new(&n.library, Default::default()));
    let pcis = devices.iter().map(|d| d.pci.clone()).collect();
    let mut observed = Observed { inner: &mut backend, session, pcis, seen: Default::default() };
    Ok((run(&mut observed, &targets, opts, progress), targets))
}

/// A backend whose every per-GPU measurement is followed by an NVML reading of that GPU.
struct Observed<'a> {
    inner: &'a mut dyn Backend,
    session: Option<crate::collect::nvml::Session>,
    pcis: Vec<String>,
    seen: std::collections::BTreeMap<usize, std::collections::BTreeMap<String, Conditions>>,
}

impl Observed<'_> {
    fn after<T>(&mut self, gpu: usize, probe: &str, r: Result<T, ProbeError>) -> Result<T, ProbeError> {
        if let (Some(s), Some(pci)) = (&self.session, self.pcis.get(gpu)) {
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
    ) -> Result<allreduce::Run, ProbeError> {
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

/// What a run would do here, from the snapshot alone: no CUDA driver is loaded and no GPU touched. The
/// GPUs are the snapshot's NVIDIA GPUs in PCI order (as CUDA numbers them under
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`). `cublas`: plan the GEMMs at cuBLAS's rates (the run will
/// find it) rather than the agent's own kernels' slower ones.
pub fn plan_here(snapshot: &crate::snapshot::Snapshot, opts: &Options<'_>, cublas: bool) -> plan::Plan {
    let mut pcis: Vec<String> = snapshot.gpus().iter().map(|g| g.address.clone()).collect();
    pcis.sort();
    let devices: Vec<cuda::DeviceInfo> =
        pcis.into_iter().map(|pci| cuda::DeviceInfo { pci, compute_mode: 0 }).collect();
    let targets = targets_of(snapshot, &devices, std::process::id());
    let memory = |pci: &str| snapshot.nvml_gpu(pci).and_then(|g| g.memory.value()).map(|m| m.total_bytes);
    plan::plan(&targets, opts, &memory, cublas)
}

/// What the probes need to know of each GPU CUDA lists, from the snapshot. `own_pid` (the
/// agent's) never makes a GPU busy.
pub fn targets_of(snapshot: &crate::snapshot::Snapshot, devices: &[cuda::DeviceInfo], own_pid: u32) -> Vec<Target> {
    devices
        .iter()
        .enumerate()
        .map(|(ordinal, d)| {
            let nv = snapshot.nvml_gpu(&d.pci);
            let links = nv.and_then(|g| g.nvlinks.value());
            let mig = nv.and_then(|g| g.mig_mode.value()).is_some_and(|m| m.current);
            let unusable = if mig {
                Some(
                    "MIG mode is on: the probes measure whole GPUs, and CUDA sees only MIG instances of it".to_string(),
                )
            } else if d.compute_mode == 2 {
                Some(
                    "its compute mode is Prohibited: no CUDA context can be made on it (nvidia-smi -c DEFAULT)"
                        .to_string(),
                )
            } else {
                None
            };
            Target {
                ordinal,
                pci: d.pci.clone(),
                device_id: snapshot.gpus().iter().find(|g| g.address == d.pci).and_then(|g| g.device),
                busy_pids: nv
                    .and_then(|g| g.processes.value())
                    .map(|ps| ps.iter().map(|p| p.pid).filter(|p| *p != own_pid).collect())
                    .unwrap_or_default(),
                unusable,
                nvlinks_active: links
                    .map(|l| l.iter().filter(|l| l.active.value() == Some(&true)).count())
                    .unwrap_or(0),
                nvlinks_known: links.is_some(),
                nvlink_peers: nv.and_then(|g| g.nvlink_p2p.value()).cloned(),
                serial: nv.and_then(|g| g.serial.value().filter(|s| !s.trim().is_empty()).or(g.uuid.value())).cloned(),
                nvlink_remotes: links
                    .map(|l| {
                        l.iter()
                            .filter(|l| l.active.value() == Some(&true))
                            .filter_map(|l| l.remote_pci.value().cloned())
                            .collect()
                    })
                    .unwrap_or_default(),
                fabric: nv.and_then(|g| g.fabric.value()).map(|f| {
                    let state = format!("{:?}", f.state).to_lowercase();
                    format!("{state}, clique {}", f.clique_id)
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::judge::{ecc_across, memory_finding};
    use super::*;
    use crate::checks::Severity;

    /// A simulated HGX: fixed per-GPU bandwidths, an optional bad GPU, a peer matrix.
    struct SimGpus {
        h2d: Vec<f64>,
        peer: bool,
        p2p: f64,
        bad_memory: Option<usize>,
        /// This GPU meets an uncorrectable ECC error (sticky) in its memory test.
        ecc_on: Option<usize>,
        no_cublas: bool,
        calls: Vec<String>,
    }

    impl SimGpus {
        fn hgx() -> Self {
            SimGpus {
                h2d: vec![55.0; 8],
                peer: true,
                p2p: 370.0,
                bad_memory: None,
                ecc_on: None,
                no_cublas: false,
                calls: vec![],
            }
        }
    }

    impl Backend for SimGpus {
        fn h2d(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            self.calls.push(format!("h2d {gpu}"));
            Ok((0..p.samples).map(|i| self.h2d[gpu] + i as f64 * 0.1).collect())
        }
        fn d2h(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            self.calls.push(format!("d2h {gpu}"));
            Ok(vec![self.h2d[gpu]; p.samples as usize])
        }
        fn bidir(&mut self, gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            Ok(vec![self.h2d[gpu] * 1.8; p.samples as usize])
        }
        fn d2d(&mut self, _gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            Ok(vec![2900.0; p.samples as usize])
        }
        fn sm_copy(&mut self, _gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            Ok(vec![3000.0; p.samples as usize])
        }
        fn host_latency(&mut self, _gpu: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            Ok(vec![1100.0; p.samples as usize])
        }
        fn peer_latency(&mut self, _a: usize, _b: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            Ok(vec![900.0; p.samples as usize])
        }
        fn can_access_peer(&mut self, _a: usize, _b: usize) -> Result<bool, ProbeError> {
            Ok(self.peer)
        }
        fn release(&mut self, gpu: usize) {
            self.calls.push(format!("release {gpu}"));
        }
        fn p2p(&mut self, src: usize, dst: usize, p: &LevelParams) -> Result<Vec<f64>, ProbeError> {
            self.calls.push(format!("p2p {src}->{dst}"));
            Ok(vec![self.p2p; p.samples as usize])
        }
        fn memory_integrity(&mut self, gpu: usize, p: &LevelParams) -> Result<MemtestResult, ProbeError> {
            self.calls.push(format!("memory {gpu}"));
            if self.ecc_on == Some(gpu) {
                return Err(ProbeError::Sticky {
                    gpu,
                    code: 214,
                    message: "cuMemsetD32Async: CUDA_ERROR_ECC_UNCORRECTABLE (214)".into(),
                });
            }
            let bad = self.bad_memory == Some(gpu);
            Ok(MemtestResult {
                bytes_tested: p.memtest_bytes as u64,
                patterns: vec!["0x00000000".into(), "0xffffffff".into()],
                mismatches: if bad { 3 } else { 0 },
                first_mismatch: bad.then(|| (0x1000, "0xfffffffe".into())),
                method: "host read-back".into(),
                chunks: 1,
                seed: None,
                passes: Vec::new(),
                seconds: None,
                ranges: Vec::new(),
            })
        }
        fn gemm(&mut self, gpu: usize, p: &LevelParams) -> Result<GemmResult, ProbeError> {
            self.calls.push(format!("gemm {gpu}"));
            if self.no_cublas {
                return Err(ProbeError::Unavailable(
                    "cuBLAS (libcublas.so.12) is not installed: the GEMM probe needs it".into(),
                ));
            }
            Ok(GemmResult {
                n: p.gemm_n,
                tflops_samples: vec![50.0, 51.0, 49.0],
                max_rel_error: 0.0,
                checked_entries: 1024,
                wrong_entries: 0,
                library: "cuBLAS".into(),
                checked_on: "host".into(),
                first_wrong: None,
                seconds: 0.1,
            })
        }
        fn gemm_tensor(&mut self, gpu: usize, p: &LevelParams, half: Half) -> Result<GemmResult, ProbeError> {
            self.calls.push(format!("gemm_tensor {gpu} {half:?}"));
            Ok(GemmResult {
                n: p.gemm_n,
                tflops_samples: vec![300.0, 301.0, 299.0],
                max_rel_error: 0.0,
                checked_entries: 3 * p.gemm_n * p.gemm_n,
                wrong_entries: 0,
                library: if half == Half::Fp16 { cuda::PTX_MMA_FP16_GEMM } else { cuda::PTX_MMA_GEMM }.into(),
                checked_on: "device".into(),
                first_wrong: None,
                seconds: 0.1,
            })
        }
    }

    fn targets(n: usize) -> Vec<Target> {
        (0..n)
            .map(|i| Target {
                ordinal: i,
                pci: format!("0000:{:02x}:00.0", 9 + i),
                device_id: Some(0x2330),
                busy_pids: vec![],
                unusable: None,
                nvlinks_active: 18,
                nvlinks_known: true,
                nvlink_peers: None,
                serial: Some(format!("16503240{i:05}")),
                nvlink_remotes: Vec::new(),
                fabric: None,
            })
            .collect()
    }

    fn opts(level: ProbeLevel) -> Options<'static> {
        Options::at(level)
    }

    fn sev(f: &[Finding], id: &str, gpu: &str) -> Severity {
        f.iter().find(|x| x.id == id && x.gpu.as_deref() == Some(gpu)).unwrap().severity
    }

    #[test]
    fn counters_that_rise_across_the_memory_test_are_a_finding_without_a_mismatch() {
        use crate::snapshot::{EccCounts, RemappedRows};
        let clean = Outcome::Ok(MemtestResult {
            bytes_tested: 1 << 30,
            patterns: vec!["address in address".into()],
            mismatches: 0,
            first_mismatch: None,
            method: "kernels".into(),
            chunks: 1,
            seed: Some(1),
            passes: Vec::new(),
            seconds: None,
            ranges: Vec::new(),
        });
        let at = |corrected, uncorrected, remapped| Conditions {
            sm_clock_mhz: None,
            mem_clock_mhz: None,
            temperature_c: None,
            power_mw: None,
            throttle_reasons: None,
            ecc_volatile: Some(EccCounts { corrected, uncorrected }),
            remapped_rows: Some(RemappedRows {
                correctable: 0,
                uncorrectable: remapped,
                pending: false,
                failure: false,
            }),
        };
        let judge = |b: &Conditions, a: &Conditions| ecc_across(memory_finding(&clean), Some(b), Some(a));
        assert_eq!(judge(&at(5, 0, 0), &at(5, 0, 0)).severity, Severity::Pass);
        let corrected = judge(&at(5, 0, 0), &at(9, 0, 0));
        assert_eq!(corrected.severity, Severity::Warn, "{corrected:?}");
        assert!(corrected.summary.contains("4 corrected ECC error(s)"), "{}", corrected.summary);
        assert_eq!(judge(&at(5, 0, 0), &at(5, 1, 0)).severity, Severity::Fail);
        assert_eq!(judge(&at(5, 0, 0), &at(5, 0, 1)).severity, Severity::Fail);
        // Without a reading on both sides nothing is claimed.
        assert_eq!(ecc_across(memory_finding(&clean), None, Some(&at(9, 9, 9))).severity, Severity::Pass);
    }

    /// The first passing run records each GPU's baseline; the same figures later pass; a GPU
    /// 12% slower host→device (still above its 48 GB/s floor) warns, naming the figure; a run
    /// with a failure records nothing.
    #[test]
    fn each_gpu_is_held_to_its_own_first_passing_run() {
        let dir = tempfile::tempdir().unwrap();
        let t = targets(8);
        let sev = |f: &[Finding], gpu: usize| {
            f.iter()
                .find(|x| x.id == "probe.baseline" && x.gpu.as_deref() == Some(t[gpu].pci.as_str()))
                .cloned()
                .unwrap()
        };
        let mut b = SimGpus::hgx();
        b.bad_memory = Some(2);
        let first = judge_here(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t, dir.path());
        assert!(sev(&first, 0).summary.starts_with("baseline recorded"), "{:?}", sev(&first, 0));
        assert!(sev(&first, 2).summary.starts_with("no baseline yet"), "{:?}", sev(&first, 2));
        let mut b = SimGpus::hgx();
        b.h2d[3] = 55.0 * 0.88;
        let later = judge_here(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t, dir.path());
        assert_eq!(sev(&later, 0).severity, Severity::Pass, "{:?}", sev(&later, 0));
        let drifted = sev(&later, 3);
        assert_eq!(drifted.severity, Severity::Warn, "{drifted:?}");
        assert!(drifted.summary.contains("host→device (GB/s) -12.0%"), "{}", drifted.summary);
        assert_eq!(
            later
                .iter()
                .find(|x| x.id == "probe.h2d-bandwidth" && x.gpu.as_deref() == Some(t[3].pci.as_str()))
                .unwrap()
                .severity,
            Severity::Pass
        );
        // GPU 2 failed the first time: its baseline comes from this, its first passing run.
        assert!(sev(&later, 2).summary.starts_with("baseline recorded"), "{:?}", sev(&later, 2));
    }

    #[test]
    fn medians_of_odd_and_even_sample_counts() {
        assert_eq!(Stat::of(vec![3.0, 1.0, 2.0]).unwrap().median, 2.0);
        assert_eq!(Stat::of(vec![4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert!(Stat::of(vec![f64::NAN]).is_none());
    }

    #[test]
    fn healthy_hgx_passes_and_measures_every_ordered_pair() {
        let mut b = SimGpus::hgx();
        let t = targets(8);
        let r = run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {});
        assert_eq!(r.gpus.len(), 8);
        assert_eq!(r.peers.len(), 56);
        assert!(r.peers.iter().all(|l| l.scope == "nvlink"));
        let f = judge(&r, &t);
        assert!(f.iter().all(|x| x.severity == Severity::Pass), "{f:#?}");
        // Eleven checks per GPU (FP32, BF16 and FP16 GEMMs among them) and the run's NVLink
        // scope; the quick level runs no all-reduce.
        assert_eq!(f.len(), 8 * 11 + 1);
        assert!(f.iter().any(|x| x.id == "probe.gemm-tensor-fp16" && x.summary.starts_with("FP16 tensor-core GEMM")));
        let scope = f.iter().find(|x| x.id == "probe.nvlink-scope").unwrap();
        assert_eq!(scope.summary, "8 GPU(s), all-to-all over NVLink, 18 links each, 56/56 pairs ≥ 335 GB/s");
    }

    #[test]
    fn a_slow_link_fails_only_its_gpu() {
        let mut b = SimGpus::hgx();
        b.h2d[3] = 14.2; // NVIDIA/nvbandwidth#6: one GPU of an H100 VM at 14.2 GB/s
        let t = targets(8);
        let f = judge(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t);
        assert_eq!(sev(&f, "probe.h2d-bandwidth", "0000:0c:00.0"), Severity::Fail);
        assert_eq!(sev(&f, "probe.h2d-bandwidth", "0000:0b:00.0"), Severity::Pass);
        let x = f.iter().find(|x| x.id == "probe.h2d-bandwidth" && x.severity == Severity::Fail).unwrap();
        assert!(x.summary.contains("below the floor of 48 GB/s"), "{}", x.summary);
    }

    #[test]
    fn busy_gpus_are_never_touched_without_force() {
        let mut b = SimGpus::hgx();
        let mut t = targets(2);
        t[1].busy_pids = vec![4242];
        let r = run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {});
        assert_eq!(r.gpus.len(), 1);
        assert!(!b.calls.iter().any(|c| c.contains(" 1") || c.contains("->1") || c.contains("1->")), "{:?}", b.calls);
        let f = judge(&r, &t);
        let skipped: Vec<_> = f.iter().filter(|x| x.gpu.as_deref() == Some("0000:0a:00.0")).collect();
        assert!(skipped.iter().all(|x| x.severity == Severity::Unknown && x.summary.contains("pid 4242")));
        let forced =
            run(&mut SimGpus::hgx(), &t, &Options { force: true, ..Options::at(ProbeLevel::Quick) }, &mut |_| {});
        assert_eq!(forced.gpus.len(), 2);
    }

    #[test]
    fn only_the_asked_gpus() {
        let mut b = SimGpus::hgx();
        let r = run(&mut b, &targets(8), &Options { only: &[2, 5], ..Options::at(ProbeLevel::Quick) }, &mut |_| {});
        assert_eq!(r.gpus.iter().map(|g| g.ordinal).collect::<Vec<_>>(), vec![2, 5]);
        assert_eq!(r.peers.len(), 2);
    }

    #[test]
    fn memory_mismatch_and_missing_cublas() {
        let mut b = SimGpus::hgx();
        b.bad_memory = Some(0);
        b.no_cublas = true;
        let t = targets(1);
        let f = judge(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t);
        let m = f.iter().find(|x| x.id == "probe.memory-integrity").unwrap();
        assert_eq!(m.severity, Severity::Fail);
        assert!(m.summary.contains("offset 0x1000"));
        assert_eq!(f.iter().find(|x| x.id == "probe.gemm").unwrap().severity, Severity::Unknown);
    }

    #[test]
    fn sxm_gpus_without_nvlink_warn_and_slow_nvlink_fails() {
        // NVML reports no active NVLink: the pair is a PCIe pair, a warning on SXM GPUs.
        let mut b = SimGpus::hgx();
        b.p2p = 40.0;
        let mut t = targets(2);
        t.iter_mut().for_each(|t| t.nvlinks_active = 0);
        let f = judge(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t);
        assert_eq!(sev(&f, "probe.p2p-bandwidth", "0000:09:00.0"), Severity::Warn);
        // Active NVLinks at PCIe speed: a degraded NVLink fails, it is not called a PCIe pair.
        let t = targets(2);
        for gbps in [40.0, 200.0] {
            let mut b = SimGpus::hgx();
            b.p2p = gbps;
            let r = run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {});
            assert!(r.peers.iter().all(|l| l.scope == "nvlink"), "{:?}", r.peers);
            assert_eq!(sev(&judge(&r, &t), "probe.p2p-bandwidth", "0000:09:00.0"), Severity::Fail, "{gbps}");
        }
    }

    #[test]
    fn a_sticky_error_is_its_gpus_memory_finding_and_spares_its_peers() {
        let mut b = SimGpus::hgx();
        b.ecc_on = Some(1);
        let t = targets(3);
        let r = run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {});
        // GPU 1 is let go at once and never used again: no GEMM, no pair.
        assert!(b.calls.contains(&"release 1".to_string()), "{:?}", b.calls);
        assert!(!b.calls.iter().any(|c| c == "gemm 1" || c.contains("->1") || c.starts_with("p2p 1")), "{:?}", b.calls);
        let f = judge(&r, &t);
        let mem =
            f.iter().find(|x| x.id == "probe.memory-integrity" && x.gpu.as_deref() == Some("0000:0a:00.0")).unwrap();
        assert_eq!(mem.severity, Severity::Fail);
        assert!(mem.summary.contains("uncorrectable ECC error (CUDA error 214)"), "{}", mem.summary);
        assert_eq!(sev(&f, "probe.gemm", "0000:0a:00.0"), Severity::Unknown);
        // GPUs 0 and 2 measured each other; their pairs with GPU 1 are not failures.
        for gpu in ["0000:09:00.0", "0000:0b:00.0"] {
            assert_eq!(sev(&f, "probe.p2p-bandwidth", gpu), Severity::Pass, "{gpu}: {f:#?}");
        }
        assert_eq!(sev(&f, "probe.p2p-bandwidth", "0000:0a:00.0"), Severity::Unknown);
    }

    #[test]
    fn unusable_gpus_are_skipped_with_their_reason() {
        let mut b = SimGpus::hgx();
        let mut t = targets(2);
        t[1].unusable = Some("MIG mode is on".into());
        let r = run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {});
        assert_eq!(r.gpus.len(), 1);
        assert!(!b.calls.iter().any(|c| c.ends_with(" 1") || c.contains("1->") || c.contains("->1")), "{:?}", b.calls);
        let f = judge(&r, &t);
        assert_eq!(sev(&f, "probe.gemm", "0000:0a:00.0"), Severity::Unknown);
    }
}
