//! How much a run measures: the level table (`quick`, `standard`, `full`), and a run's options
//! over it (which GPUs, busy ones forced, the GEMM's time, the all-reduce's message).
//! Every number carries its source or says it is our choice.

use crate::config::ProbeLevel;
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
    /// Seconds of FP64 GEMM on every probed GPU at once while NVML's power reading is sampled
    /// (0: none): DCGM's targeted-power test.
    #[serde(default)]
    pub power_secs: u32,
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
            power_secs: 0,
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
            power_secs: 0,
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
            // Half a minute of every GPU on the tensor cores, then half a minute on FP64 with the
            // boards' power sampled (`power_secs`): a minute of all GPUs at full load, long enough
            // for clocks to settle under the power and thermal limits a node reaches only with all
            // its GPUs busy. (Until the power test came, the tensor cores had the whole minute.)
            gemm_secs: 30,
            // Our choice, within the level's budget: DCGM's targeted-power test runs 120 s by
            // default (DCGM diag documentation, "Targeted Power", `test_duration`), and judges the
            // highest reading; a board under a sustained GEMM reaches its steady draw within
            // seconds, which NVML averages over one second on Hopper
            // (`nvmlDeviceGetPowerUsage`), so 30 s holds it there many times over.
            power_secs: 30,
            gemm_n: 16384,
            gemm_reps: 10,
            // 16 GiB, the message Azure's NCCL health check runs (azurehpc-health-checks,
            // `check_nccl_allreduce … 16G` in its ND H100 v5 and ND H200 v5 configurations).
            allreduce_bytes: 16 * 1024 * MIB,
            allreduce_samples: 3,
        },
    }
}

pub struct Options<'a> {
    pub level: ProbeLevel,
    /// Only these GPUs, by position in PCI bus order as nvidia-smi numbers them (empty: all).
    pub only: &'a [usize],
    /// Run on GPUs with compute processes too.
    pub force: bool,
    /// Seconds of the all-GPU GEMM instead of the level's (`--gemm-seconds`; 0: none).
    pub gemm_seconds: Option<u32>,
    /// Seconds of the FP64 power test instead of the level's (`--power-seconds`; 0: none).
    pub power_seconds: Option<u32>,
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
            power_seconds: None,
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
