//! How much GPU time a probe run will take, computed before it starts from the level's sizes and
//! loop counts and each GPU's floors (`probe --dry-run`). At the floors the figure is an upper
//! bound for a healthy GPU: one that meets its floors finishes sooner. Context creation, the
//! host's share of the memory compare and process start are not GPU time and are not counted.

use super::cuda_backend::{copies, gemm};
use super::kernels::{self, Step};
use super::levels::{LevelParams, Options};
use super::targets::Target;
use crate::config::ProbeLevel;
use crate::facts;
use serde::Serialize;

/// Rates for a GPU the facts have no floor for: the slowest Hopper SKU's figures (H100 PCIe:
/// HBM 1230 GB/s read + write, FP32 GEMM 15.4 TFLOP/s, DCGM `diag-skus.yaml.in`) and a PCIe
/// Gen5 x16 copy (48 GB/s), so an unknown GPU is planned at the slow end.
const FALLBACK_PCIE_GBPS: f64 = 48.0;
const FALLBACK_HBM_GBPS: f64 = 1230.0;
const FALLBACK_TFLOPS: f64 = 15.4;

/// The quick level's budget on an 8-GPU HGX, in seconds of GPU time.
pub const QUICK_BUDGET_S: f64 = 10.0;
/// The standard level's budget.
pub const STANDARD_BUDGET_S: f64 = 120.0;

/// The agent's own FP32 GEMM (`phq_sgemm`, used where cuBLAS is missing), planned at 3 TFLOP/s:
/// each fused multiply-add of its 16 × 16 tiles reads two shared-memory words, and a warp's 32
/// multiply-adds take two shared-memory wavefronts, so an SM does at most 16 a clock — 132 SMs
/// at 1.755 GHz make a ceiling of about 7.4 TFLOP/s on the H100 SXM (CUDA programming guide,
/// "Shared Memory" of compute capability 9.0: 32 banks, one wavefront a clock). Measured on an
/// H200 at 1,980 MHz: 8.1 TFLOP/s at 2048² (docs/hardware-validation.md); the plan stays under it
/// for slower clocks and fewer SMs (the H100 PCIe's 114).
pub const PTX_SGEMM_TFLOPS: f64 = 3.0;

/// The agent's tensor-core GEMM (`phq_mma_gemm`), planned at 12 TFLOP/s: each warp loads its A
/// and B fragments from global memory for every `mma.sync` (768 bytes per 4,096 operations, no
/// staging in shared memory), so the caches' bandwidth bounds it, far below the tensor cores'
/// peak. Measured on an H200: 19.6 TFLOP/s at 4096², BF16 and FP16 alike
/// (docs/hardware-validation.md; the plan had said 50, which made a run without cuBLAS outlast
/// it); 12 leaves room for an H100 PCIe's fewer SMs and lower clocks.
pub const PTX_MMA_TFLOPS: f64 = 12.0;

/// cuBLAS's BF16 GEMM (`cublasGemmEx`), planned at 400 TFLOP/s: well under the H100 SXM's
/// dense BF16 peak of 989 (NVIDIA's H100 datasheet), so an H100 PCIe (756) and a GPU held back by
/// power are inside the plan too. Our planning figure, not a measurement.
pub const CUBLAS_BF16_TFLOPS: f64 = 400.0;

/// The memory-test kernels are planned at the SKU's device-copy floor: like a copy they stream
/// HBM with several loads in flight per thread (four words each, `phq_mem_check`), reading and
/// writing. Our planning assumption until a GPU measures it (docs/hardware-validation.md).
const MEMTEST_RATE_OF_D2D: f64 = 1.0;

/// What a dependent load is planned at, host or peer memory: a round figure above what PCIe and
/// NVLink round trips take (about a microsecond), our planning assumption, not a floor.
const PLANNED_LATENCY_S: f64 = 2e-6;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuPlan {
    pub index: usize,
    pub pci: String,
    pub sku: Option<String>,
    pub h2d_s: f64,
    pub d2h_s: f64,
    pub bidir_s: f64,
    pub d2d_s: f64,
    pub sm_copy_s: f64,
    pub latency_s: f64,
    /// The memory test's passes; its bit-fade pauses are the plan's `fade_s`, shared by all GPUs.
    pub memory_s: f64,
    pub memory_bytes: u64,
    pub gemm_s: f64,
    /// The tensor-core GEMMs (BF16, then FP16).
    pub gemm_tensor_s: f64,
    pub total_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairPlan {
    pub src: usize,
    pub dst: usize,
    /// The rate the pair is planned at: its NVLink floor when both GPUs have active NVLinks,
    /// else PCIe.
    pub gbps: f64,
    /// The copies and the latency chase.
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub level: ProbeLevel,
    pub params: LevelParams,
    pub gpus: Vec<GpuPlan>,
    pub pairs: Vec<PairPlan>,
    pub skipped: Vec<super::results::Skipped>,
    /// The all-GPU GEMM: every GPU at once, so counted once.
    pub gemm_sustained_s: f64,
    /// The FP64 power test: every GPU at once, so counted once.
    #[serde(default)]
    pub power_s: f64,
    /// The bit-fade pauses: every GPU's memory test waits them at once, so counted once.
    pub fade_s: f64,
    /// NCCL's all-reduce over every GPU, twice (as NCCL chooses, NVLS off), at the slowest
    /// pair's rate; NCCL's start is not GPU time and is not counted.
    #[serde(default)]
    pub allreduce_s: f64,
    /// The GEMM the plan times: cuBLAS, or the agent's PTX kernel where cuBLAS is missing.
    pub gemm_library: String,
    pub total_s: f64,
    /// The level's budget, where it has one.
    pub budget_s: Option<f64>,
}

/// The GPUs a real run would probe (the same choice: `--gpu`, busy, MIG) and the GPU time each
/// part takes at the floors.
/// `cublas`: whether the run would find cuBLAS (else it times the agent's own GEMM).
pub fn estimate(
    targets: &[Target],
    opts: &Options<'_>,
    memory_total: &dyn Fn(&str) -> Option<u64>,
    cublas: bool,
) -> Plan {
    let p = opts.params();
    let (chosen, skipped) = super::targets::choose(targets, opts);
    let rounds = (p.samples + 1) as f64 * p.copies_per_sample as f64; // a warm-up, then the samples
    let copy = rounds * p.buffer_bytes as f64;
    let secs = |bytes: f64, gbps: f64| bytes / (gbps * 1e9);
    // A latency chase (host or peer): a warm-up of a tenth, then the samples.
    let chase = (p.samples as f64 + 0.1) * copies::LATENCY_STEPS as f64 * PLANNED_LATENCY_S;
    let fade = std::time::Duration::from_secs(p.fade_secs.into());
    let mut gpus = Vec::new();
    for (t, index) in &chosen {
        let f = facts::probe_floors(t.device_id.unwrap_or(0));
        let h2d = f.h2d_gbps.unwrap_or(FALLBACK_PCIE_GBPS);
        let d2h = f.d2h_gbps.unwrap_or(FALLBACK_PCIE_GBPS);
        let hbm = f.d2d_gbps.unwrap_or(FALLBACK_HBM_GBPS);
        let tflops = if cublas { f.gemm_tflops.unwrap_or(FALLBACK_TFLOPS) } else { PTX_SGEMM_TFLOPS };
        let memtest_gbps = hbm * MEMTEST_RATE_OF_D2D;
        // As the memory test sizes itself: 90% of the GPU's memory (of what is free, when it runs).
        // Each step moves its bytes through HBM once (a write or a check) or twice (a check that
        // rewrites); every check and pause first writes twice the L2 (50 MB on an H100) to evict
        // it; the fade pauses are the plan's, shared.
        let memory_bytes = memory_total(&t.pci).map(|m| m / 10 * 9).unwrap_or(p.memtest_bytes as u64) as f64;
        let evict = 2.0 * 50e6;
        let memory_s: f64 = kernels::steps(opts.level, 0, fade)
            .iter()
            .map(|s| match s {
                Step::Write(_) => secs(memory_bytes, memtest_gbps),
                Step::Check { then: None, .. } => secs(memory_bytes + evict, memtest_gbps),
                Step::Check { then: Some(_), .. } => secs(2.0 * memory_bytes + evict, memtest_gbps),
                Step::Pause(_) => secs(evict, memtest_gbps),
            })
            .sum();
        let memory_bytes = memory_bytes as u64;
        // As the probes size them: the agent's own kernels at half the side (gemm::gemm_side).
        let n = gemm::gemm_side(p.gemm_n, cublas) as f64;
        let gemm_s = (1 + gemm::GEMM_SAMPLES as u32 * p.gemm_reps) as f64 * 2.0 * n.powi(3) / (tflops * 1e12)
            + secs(2.0 * n * n * 4.0, h2d);
        let products = (1 + gemm::GEMM_SAMPLES as u32 * p.gemm_reps) as f64 * 2.0 * n.powi(3);
        let tensor_tflops = if cublas { CUBLAS_BF16_TFLOPS } else { PTX_MMA_TFLOPS };
        let gemm_tensor_s = 2.0 * (products / (tensor_tflops * 1e12) + secs(2.0 * n * n * 2.0, h2d));
        let mut g = GpuPlan {
            index: *index,
            pci: t.pci.clone(),
            sku: t.device_id.and_then(facts::sku).map(|s| s.name.to_string()),
            h2d_s: secs(copy, h2d),
            d2h_s: secs(copy, d2h),
            bidir_s: secs(2.0 * copy, h2d.min(d2h)),
            d2d_s: secs(2.0 * copy, hbm),
            sm_copy_s: secs(2.0 * copy, hbm),
            latency_s: chase,
            memory_s,
            memory_bytes,
            gemm_s,
            gemm_tensor_s,
            total_s: 0.0,
        };
        g.total_s = g.h2d_s
            + g.d2h_s
            + g.bidir_s
            + g.d2d_s
            + g.sm_copy_s
            + g.latency_s
            + g.memory_s
            + g.gemm_s
            + g.gemm_tensor_s;
        gpus.push(g);
    }
    let mut pairs = Vec::new();
    for (a, ia) in &chosen {
        for (b, ib) in &chosen {
            if ia == ib {
                continue;
            }
            let gbps = pair_rate(a, b);
            pairs.push(PairPlan { src: *ia, dst: *ib, gbps, seconds: secs(copy, gbps) + chase });
        }
    }
    let gemm_sustained_s = if gpus.is_empty() { 0.0 } else { opts.gemm_seconds.unwrap_or(p.gemm_secs) as f64 };
    let power_s = if gpus.is_empty() { 0.0 } else { opts.power_seconds.unwrap_or(p.power_secs) as f64 };
    let fade_s: f64 = if gpus.is_empty() {
        0.0
    } else {
        kernels::steps(opts.level, 0, fade)
            .iter()
            .map(|s| if let Step::Pause(d) = s { d.as_secs_f64() } else { 0.0 })
            .sum()
    };
    let ranked: Vec<&Target> = chosen.iter().map(|(t, _)| *t).collect();
    let allreduce_s = 2.0 * super::allreduce::planned_s(&p, ranked.len(), allreduce_rate(&ranked));
    let total_s = gpus
        .iter()
        .map(|g| g.total_s)
        .chain(pairs.iter().map(|p| p.seconds))
        .fold(gemm_sustained_s + power_s + fade_s + allreduce_s, |a, b| a + b);
    let gemm_library = if cublas { "cuBLAS" } else { gemm::PTX_GEMM }.to_string();
    let budget_s = match opts.level {
        ProbeLevel::None | ProbeLevel::Quick => Some(QUICK_BUDGET_S),
        ProbeLevel::Standard => Some(STANDARD_BUDGET_S),
        ProbeLevel::Full => None,
    };
    Plan {
        level: opts.level,
        params: p,
        gpus,
        pairs,
        skipped,
        gemm_sustained_s,
        power_s,
        fade_s,
        allreduce_s,
        gemm_library,
        total_s,
        budget_s,
    }
}

/// The bus bandwidth an all-reduce over `targets` is planned at: the slowest pair's planned rate
/// (its NVLink floor, else PCIe), what a ring reaches; NVLS, where NCCL uses it, is faster.
pub fn allreduce_rate(targets: &[&Target]) -> f64 {
    let mut slowest = f64::INFINITY;
    for a in targets {
        for b in targets.iter().filter(|b| b.pci != a.pci) {
            slowest = slowest.min(pair_rate(a, b));
        }
    }
    if slowest.is_finite() {
        slowest
    } else {
        FALLBACK_PCIE_GBPS
    }
}

/// The rate a pair's copies are planned at: its NVLink floor when NVML (or, without NVML's
/// answer, active links on both) puts it on NVLink, else PCIe.
fn pair_rate(a: &Target, b: &Target) -> f64 {
    let nvlink = match &a.nvlink_peers {
        Some(peers) => peers.contains(&b.pci),
        None => a.nvlinks_active > 0 && b.nvlinks_active > 0,
    };
    facts::probe_floors(a.device_id.unwrap_or(0)).p2p_gbps.filter(|_| nvlink).unwrap_or(FALLBACK_PCIE_GBPS)
}

/// The plan as a person reads it.
pub fn render(plan: &Plan) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "probe plan, level {}: {} GPU(s), {} ordered pair(s); GPU time at each SKU's floors (a healthy GPU is faster)",
        format!("{:?}", plan.level).to_lowercase(),
        plan.gpus.len(),
        plan.pairs.len()
    );
    let side = gemm::gemm_side(plan.params.gemm_n, plan.gemm_library != gemm::PTX_GEMM);
    let _ = writeln!(
        s,
        "  copies: {} MiB × {} per sample × {} samples + a warm-up; memory test: 90% of each GPU's memory, {} passes on the GPU, all GPUs at once; GEMM ({}) {}² × {} × {} samples + a warm-up; tensor-core GEMMs {}²",
        plan.params.buffer_bytes >> 20,
        plan.params.copies_per_sample,
        plan.params.samples,
        kernels::steps(plan.level, 0, std::time::Duration::from_secs(plan.params.fade_secs.into())).len(),
        plan.gemm_library,
        side,
        plan.params.gemm_reps,
        gemm::GEMM_SAMPLES,
        side
    );
    for g in &plan.gpus {
        let _ = writeln!(
            s,
            "  GPU {} {} {:<16} h2d {:.2} s · d2h {:.2} s · both {:.2} s · device copy {:.2} s · SM copy {:.2} s · latency {:.2} s · memory {:.2} s · GEMM {:.2} s · tensor GEMM {:.2} s = {:.2} s",
            g.index,
            g.pci,
            g.sku.as_deref().unwrap_or("unknown SKU"),
            g.h2d_s,
            g.d2h_s,
            g.bidir_s,
            g.d2d_s,
            g.sm_copy_s,
            g.latency_s,
            g.memory_s,
            g.gemm_s,
            g.gemm_tensor_s,
            g.total_s
        );
    }
    if !plan.pairs.is_empty() {
        let secs: f64 = plan.pairs.iter().map(|p| p.seconds).sum();
        let slowest = plan.pairs.iter().map(|p| p.gbps).fold(f64::INFINITY, f64::min);
        let _ =
            writeln!(s, "  peers: {} pair(s), {secs:.2} s (slowest planned rate {slowest:.0} GB/s)", plan.pairs.len());
    }
    if plan.fade_s > 0.0 {
        let _ = writeln!(s, "  bit fade: {:.0} s of pauses, all GPUs' memory left alone together", plan.fade_s);
    }
    if plan.allreduce_s > 0.0 {
        let _ = writeln!(
            s,
            "  all-reduce (NCCL, every GPU): {} MiB × ({} warm-up + {} × {}), as NCCL chooses and with NVLS off, {:.2} s",
            plan.params.allreduce_bytes >> 20,
            super::allreduce::WARMUP,
            plan.params.allreduce_samples,
            super::allreduce::ITERS,
            plan.allreduce_s
        );
    }
    if plan.gemm_sustained_s > 0.0 {
        let _ = writeln!(s, "  all GPUs at once: GEMM for {:.0} s", plan.gemm_sustained_s);
    }
    if plan.power_s > 0.0 {
        let _ = writeln!(
            s,
            "  all GPUs at once: FP64 GEMM for {:.0} s, each board's power held to its target",
            plan.power_s
        );
    }
    if plan.gpus.is_empty() && plan.skipped.is_empty() {
        let _ = writeln!(s, "  no NVIDIA GPU to probe: the machine's PCI devices list none");
    }
    for k in &plan.skipped {
        let _ = writeln!(s, "  {} not probed: {}", k.pci, k.reason);
    }
    let budget = match plan.budget_s {
        Some(b) if plan.total_s <= b => format!(" (within the level's {b:.0} s budget)"),
        Some(b) => format!(" (over the level's {b:.0} s budget)"),
        None => String::new(),
    };
    let _ = writeln!(s, "total: {:.1} s of GPU time{budget}", plan.total_s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hgx(n: usize) -> Vec<Target> {
        (0..n)
            .map(|i| Target {
                ordinal: i,
                pci: format!("0000:{:02x}:00.0", 9 + i),
                device_id: Some(0x2330),
                busy_pids: Vec::new(),
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

    fn total(level: ProbeLevel) -> Plan {
        estimate(&hgx(8), &Options::at(level), &|_| Some(80 << 30), true)
    }

    #[test]
    fn quick_and_standard_fit_their_budgets_on_an_hgx() {
        let q = total(ProbeLevel::Quick);
        assert_eq!((q.gpus.len(), q.pairs.len()), (8, 56));
        assert!(q.total_s <= QUICK_BUDGET_S, "{}", render(&q));
        let s = total(ProbeLevel::Standard);
        assert!(s.total_s <= STANDARD_BUDGET_S, "{}", render(&s));
        assert!(s.total_s > q.total_s);
    }

    /// On the agent's own kernels (no cuBLAS) every level fits too: quick and standard their
    /// budgets, and the full level 600 s (twice cuBLAS's 300), with its GEMM at half the side.
    #[test]
    fn without_cublas_every_level_fits_its_budget_on_an_hgx() {
        let own = |level| estimate(&hgx(8), &Options::at(level), &|_| Some(80 << 30), false);
        let (q, s, f) = (own(ProbeLevel::Quick), own(ProbeLevel::Standard), own(ProbeLevel::Full));
        assert!(q.total_s <= QUICK_BUDGET_S, "{}", render(&q));
        assert!(s.total_s <= STANDARD_BUDGET_S, "{}", render(&s));
        assert!(f.total_s <= 600.0, "{}", render(&f));
        assert!(render(&q).contains("GEMM (PTX fallback (phq_sgemm)) 2048² × 5 × 3 samples"), "{}", render(&q));
        // And with cuBLAS the full level stays within 300 s.
        let full = total(ProbeLevel::Full);
        assert!(full.total_s <= 300.0, "{}", render(&full));
        assert!(render(&full).contains("GEMM (cuBLAS) 16384² × 10"), "{}", render(&full));
    }

    #[test]
    fn the_plan_counts_what_the_probes_move() {
        let p = estimate(&hgx(1), &Options::at(ProbeLevel::Quick), &|_| Some(80 << 30), true);
        let g = &p.gpus[0];
        // 4 rounds (warm-up + 3 samples) × 8 copies × 64 MiB = 2 GiB at the 48 GB/s floor.
        assert!((g.h2d_s - (2u64 << 30) as f64 / 48e9).abs() < 1e-9, "{g:?}");
        // The memory test covers 90% of the GPU's memory at every level, as the probe sizes it;
        // quick's six passes (three writes, three checks) each move it through HBM once, and
        // each check first writes twice the L2 (100 MB) to evict it.
        assert_eq!(g.memory_bytes, (80u64 << 30) / 10 * 9);
        let once = g.memory_bytes as f64 / 1905e9;
        assert!((g.memory_s - 6.0 * once - 3.0 * 100e6 / 1905e9).abs() < 1e-9, "{g:?}");
        assert_eq!((p.fade_s, p.gemm_library.as_str()), (0.0, "cuBLAS"));
        let small = estimate(&hgx(1), &Options::at(ProbeLevel::Full), &|_| Some(10 << 30), true);
        assert_eq!(small.gpus[0].memory_bytes, (10u64 << 30) / 10 * 9);
    }

    /// The service's deadline for a probe child: twice the plan and the margin, and NCCL's
    /// allowance once for each of the two all-reduces where the level runs them (each all-reduce
    /// child may take that much beyond its transfers) — none at quick, none on one GPU.
    #[test]
    fn the_service_deadline_allows_for_each_all_reduce() {
        use super::super::child::{deadline_for, Limits};
        use std::time::Duration;
        let limits = Limits { margin: Duration::from_secs(120), nccl_allowance: Duration::from_secs(180) };
        let standard = total(ProbeLevel::Standard);
        assert!(standard.allreduce_s > 0.0);
        // Each all-reduce child: NCCL's 180 s and 30 s to exit after its answer.
        let want = Duration::from_secs_f64(2.0 * standard.total_s) + Duration::from_secs(120 + 2 * (180 + 30));
        assert_eq!(deadline_for(&standard, limits), want);
        let quick = total(ProbeLevel::Quick);
        assert_eq!(
            deadline_for(&quick, limits),
            Duration::from_secs_f64(2.0 * quick.total_s) + Duration::from_secs(120)
        );
        let one = estimate(&hgx(1), &Options::at(ProbeLevel::Standard), &|_| Some(80 << 30), true);
        assert_eq!(deadline_for(&one, limits), Duration::from_secs_f64(2.0 * one.total_s) + Duration::from_secs(120));
    }

    #[test]
    fn bit_fade_is_one_pause_for_all_gpus() {
        let full = total(ProbeLevel::Full);
        // The full level's two 20 s pauses, once for the eight GPUs, not once each.
        assert_eq!(full.fade_s, 40.0);
        let parts: f64 = full.gpus.iter().map(|g| g.total_s).sum::<f64>()
            + full.pairs.iter().map(|p| p.seconds).sum::<f64>()
            + full.gemm_sustained_s
            + full.power_s
            + full.allreduce_s;
        assert!((full.total_s - parts - 40.0).abs() < 1e-6, "{}", render(&full));
        assert!(full.gpus.iter().all(|g| g.memory_s < 20.0), "{}", render(&full));
        assert!(render(&full).contains("bit fade: 40 s of pauses"), "{}", render(&full));
        // The all-reduce twice over the 8 GPUs, at the NVLink floor's 335 GB/s: 2 × 65 × 16 GiB ×
        // 1.75 / 335e9.
        assert!((full.allreduce_s - 2.0 * 65.0 * 1.75 * (16u64 << 30) as f64 / 335e9).abs() < 1e-6);
        assert!(render(&full).contains("all-reduce (NCCL, every GPU): 16384 MiB × (5 warm-up + 3 × 20)"));
    }

    #[test]
    fn without_cublas_the_gemm_is_planned_at_the_ptx_kernels_rate() {
        let opts = Options::at(ProbeLevel::Quick);
        let with = estimate(&hgx(1), &opts, &|_| Some(80 << 30), true);
        let without = estimate(&hgx(1), &opts, &|_| Some(80 << 30), false);
        assert_eq!(without.gemm_library, crate::probe::cuda_backend::gemm::PTX_GEMM);
        assert!(render(&without).contains("PTX fallback"), "{}", render(&without));
        // An eighth of the products (half the side, gemm::ptx_sgemm_n) at 3 TFLOP/s instead of the
        // H100 SXM's cuBLAS floor; the upload, of a quarter of the bytes.
        let n = without.params.gemm_n as f64;
        let products = (1 + crate::probe::cuda_backend::gemm::GEMM_SAMPLES as u32 * without.params.gemm_reps) as f64;
        let upload = with.gpus[0].gemm_s
            - products * 2.0 * n.powi(3) / (facts::probe_floors(0x2330).gemm_tflops.unwrap() * 1e12);
        let want = products * 2.0 * (n / 2.0).powi(3) / (PTX_SGEMM_TFLOPS * 1e12) + upload / 4.0;
        assert!((without.gpus[0].gemm_s - want).abs() < 1e-9, "{:?}", without.gpus[0]);
        assert!(without.gpus[0].gemm_s > with.gpus[0].gemm_s / 8.0);
    }
}
