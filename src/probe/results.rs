//! What a probe run found: the result types of one run (`ProbeReport`, its GPUs, pairs and
//! all-reduce), serialised into the report's `probes` and rendered by `report`. Data only: no
//! measuring and no judging here.

use super::levels::LevelParams;
use crate::config::ProbeLevel;
use crate::cuda::nccl;
use crate::snapshot::Conditions;
use serde::{Deserialize, Serialize};

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
    /// A library the measurement needs loads but does not start (NCCL's communicators): the
    /// guest's software, not the GPUs. `error` is the library's answer; `library` its version
    /// and file; `driver_cuda` the CUDA version the driver supports; `warning` why, in its words.
    #[error("{error}")]
    NotStarted {
        error: String,
        library: String,
        driver_cuda: String,
        /// The library's own last warning, where it keeps one (`ncclGetLastError`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        warning: Option<String>,
    },
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
    /// Why cuBLAS was not used although it is installed: it loads but cannot start (the
    /// agent's kernels ran instead; `probe.cublas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas_cannot_start: Option<String>,
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
    /// The FP64 GEMM on every probed GPU at once while its power was sampled (the power test).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_fp64: Option<Outcome<GemmResult>>,
    /// What NVML read of the board's power while `gemm_fp64` ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<PowerRun>,
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
    /// Other processes seen using the GPU while it was probed (issue 51): its figures are then
    /// not the hardware's alone, and `judge::contended` makes a shortfall `unknown`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub contended_by: Vec<Contender>,
}

/// A process that is not the probe's, seen on a GPU before or after one of its measurements.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Contender {
    /// Its pid; 0 when NVML listed no process but the GPU was busy before the first measurement.
    pub pid: u32,
    /// Its name from `/proc`, when the probe may read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// When it was seen: `before h2d`, `after gemm`, …; the first look only.
    pub seen: String,
    /// What NVML said of it: the memory it holds, or the GPU's utilisation.
    pub what: String,
}

impl std::fmt::Display for Contender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.pid, &self.name) {
            (0, _) => write!(f, "{}, {}", self.what, self.seen),
            (pid, Some(n)) => write!(f, "pid {pid} ({n}), {}, {}", self.what, self.seen),
            (pid, None) => write!(f, "pid {pid}, {}, {}", self.what, self.seen),
        }
    }
}

/// NVML's power readings of one board while the FP64 GEMM loaded it
/// (`nvmlDeviceGetPowerUsage`, averaged by the driver over the last second on Hopper).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PowerRun {
    /// Readings taken.
    pub samples: u32,
    /// The highest, W (what DCGM's targeted-power test judges).
    pub max_w: Option<f64>,
    /// Their mean, W.
    pub avg_w: Option<f64>,
    /// The power limit the board enforces (`nvmlDeviceGetEnforcedPowerLimit`), W.
    pub limit_w: Option<f64>,
    /// Why a reading failed, the first time one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
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
    pub allreduce: Option<AllReduce>,
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

/// The all-reduce part of a probe report (`allreduce.rs` measures it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllReduce {
    /// The GPUs, rank by rank, by PCI address.
    pub gpus: Vec<String>,
    /// Message size asked per rank (`Run::bytes` is what ran, smaller where memory was short).
    pub bytes: u64,
    /// As NCCL chooses its algorithm.
    pub nccl: Outcome<Run>,
    /// With `NCCL_NVLS_ENABLE=0`; measured only after the first run succeeded.
    pub nvls_off: Option<Outcome<Run>>,
    /// Each run's deadline.
    pub deadline_s: u64,
}

/// One measured configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// Bus bandwidth per sample, GB/s.
    pub busbw_gbps: Stat,
    /// Algorithm bandwidth of the median sample, GB/s.
    pub algbw_gbps: f64,
    pub bytes: u64,
    pub iters: u32,
    /// NCCL's version and the file it was loaded from.
    pub library: String,
    /// Words (8 bytes) of results compared on the GPUs, and those that were not the sum.
    pub checked_words: u64,
    pub wrong_words: u64,
    /// The first wrong word: GPU, address, what it held, what it should.
    pub first_wrong: Option<String>,
    /// Why the message is smaller than asked, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Whether every GPU reports `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` (NVLS needs it);
    /// `None` where the driver would not say.
    #[serde(default)]
    pub multicast: Option<bool>,
    /// The `NCCL_*` settings the child ran with, and where each came from.
    #[serde(default)]
    pub settings: Vec<nccl::Setting>,
}

/// Whether `e` is CUDA's uncorrectable ECC error (214).
pub(crate) fn is_ecc(e: &ProbeError) -> bool {
    matches!(e, ProbeError::Sticky { code: crate::cuda::code::ECC_UNCORRECTABLE, .. })
}
