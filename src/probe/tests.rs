//! The run loop and its judging over the simulated GPUs of `fake.rs`.

use super::fake::{targets, SimGpus};
use super::judge::{self, ecc_across, memory_finding};
use super::results::Contender;
use super::*;
use crate::checks::{Finding, Severity};
use crate::config::ProbeLevel;
use crate::snapshot::Conditions;

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
        remapped_rows: Some(RemappedRows { correctable: 0, uncorrectable: remapped, pending: false, failure: false }),
        processes: None,
        utilization_gpu: None,
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
        f.iter().find(|x| x.id == "probe.baseline" && x.gpu.as_deref() == Some(t[gpu].pci.as_str())).cloned().unwrap()
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

/// A run on the agent's own GEMM kernel (cuBLAS gone) is not compared with a baseline made
/// with cuBLAS: on an H200 that read as a GPU that lost 84% (docs/hardware-validation.md).
#[test]
fn a_run_without_cublas_is_not_held_to_cublas_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let t = targets(1);
    let mut b = SimGpus::hgx();
    let first = judge_here(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t, dir.path());
    let baseline = |f: &[Finding]| f.iter().find(|x| x.id == "probe.baseline").cloned().unwrap();
    assert!(baseline(&first).summary.starts_with("baseline recorded"), "{:?}", baseline(&first));
    b.own_kernels = true;
    let later = judge_here(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t, dir.path());
    assert_eq!(baseline(&later).severity, Severity::Pass, "{}", baseline(&later).summary);
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
    // Eleven checks per GPU (FP32, BF16 and FP16 GEMMs among them), the run's NVLink scope and
    // whether its GEMMs could use cuBLAS; the quick level runs no all-reduce.
    assert_eq!(f.len(), 8 * 11 + 2);
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
    let forced = run(&mut SimGpus::hgx(), &t, &Options { force: true, ..Options::at(ProbeLevel::Quick) }, &mut |_| {});
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
    let mem = f.iter().find(|x| x.id == "probe.memory-integrity" && x.gpu.as_deref() == Some("0000:0a:00.0")).unwrap();
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

#[test]
fn a_pcie_pair_is_a_warning_only_where_the_sku_promises_nvlink() {
    // Two cards without NVLink between them: an H100 PCIe may have no bridge fitted (no alarm),
    // an H100 NVL is sold bridged (the pair lacks its NVLink: a warning).
    for (device, want) in [(0x2331, Severity::Pass), (0x2321, Severity::Warn)] {
        let mut b = SimGpus::hgx();
        b.p2p = 40.0;
        let mut t = targets(2);
        t.iter_mut().for_each(|t| {
            t.nvlinks_active = 0;
            t.device_id = Some(device);
        });
        let f = judge(&run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {}), &t);
        assert_eq!(sev(&f, "probe.p2p-bandwidth", "0000:09:00.0"), want, "{device:#x}");
    }
}

/// Issue 51 hole 3: on a GPU another process used during the run, a shortfall is `unknown`
/// naming the process, while a wrong result and a pass stay what they are; a peer check hears
/// of a contender on any probed GPU.
#[test]
fn a_contended_gpus_shortfall_is_unknown_and_its_wrong_result_still_fails() {
    let mut b = SimGpus::hgx();
    let t = targets(2);
    let mut r = run(&mut b, &t, &opts(ProbeLevel::Quick), &mut |_| {});
    let (pci0, pci1) = (r.gpus[0].pci.clone(), r.gpus[1].pci.clone());
    r.gpus[1].contended_by = vec![Contender {
        pid: 4242,
        name: Some("train.py".into()),
        seen: "before d2h".into(),
        what: "8192 MiB of GPU memory".into(),
    }];
    let mut f = vec![
        Finding::fail("probe.h2d-bandwidth", "12 GB/s").gpu(&pci1),
        Finding::fail("probe.memory-integrity", "3 mismatching words")
            .gpu(&pci1)
            .evidence("memtest", serde_json::json!({"mismatches": 3})),
        Finding::pass("probe.d2h-bandwidth", "55 GB/s").gpu(&pci1),
        Finding::fail("probe.h2d-bandwidth", "12 GB/s").gpu(&pci0),
        Finding::warn("probe.p2p-bandwidth", "slow").gpu(&pci0),
        // The all-reduce's wrong sum, as `allreduce_finding` carries it.
        Finding::fail("probe.allreduce", "wrong sum")
            .evidence("allreduce", serde_json::json!({"nccl": {"ok": {"wrong_words": 7}}, "nvls_off": null})),
    ];
    judge::contended(&r, &mut f);
    let sev = |i: usize| f[i].severity;
    assert_eq!(sev(0), Severity::Unknown, "{:#?}", f[0]);
    assert!(f[0].summary.contains("pid 4242 (train.py)") && f[0].detail.contains("12 GB/s"), "{:#?}", f[0]);
    assert_eq!(sev(1), Severity::Fail, "a wrong result is no contender's doing");
    assert_eq!(sev(2), Severity::Pass);
    assert_eq!(sev(3), Severity::Fail, "GPU 0 had no contender");
    assert_eq!(sev(4), Severity::Unknown, "a peer copy hears of a contender on its peer");
    assert_eq!(sev(5), Severity::Fail, "a wrong all-reduce sum is no contender's doing");
    // A sticky error on the contended GPU: its failures stay failures.
    r.gpus[1].h2d_gbps = Outcome::Error(ProbeError::Sticky { gpu: 1, code: 700, message: "illegal address".into() });
    let mut f = vec![Finding::fail("probe.gemm", "GEMM failed to run: illegal address").gpu(&pci1)];
    judge::contended(&r, &mut f);
    assert_eq!(f[0].severity, Severity::Fail, "{:#?}", f[0]);
}
