//! Judging a probe run: one function per probe, each turning its figures into a finding against
//! the SKU's floors, the GPU's own baseline and what NVML read beside it. A new probe adds a
//! `Backend` method, its measurement on the CUDA backend (`copies.rs`, `memtest.rs` or
//! `gemm.rs`) and its finding here.

use super::baseline;
use super::cuda_backend::gemm;
use super::results::{
    is_ecc, AllReduce, GemmResult, GpuProbes, MemtestResult, NvlinkScope, Outcome, PeerLink, ProbeError, ProbeReport,
    Stat,
};
use super::targets::Target;
use crate::checks::Finding;
use crate::facts::{self, ProbeFloors};
use crate::snapshot::Conditions;

/// Every probe check as `unknown` with the reason the probes could not run.
pub fn unavailable(why: &str) -> Vec<Finding> {
    crate::checks::CATALOG
        .iter()
        .filter(|id| id.starts_with("probe."))
        .map(|id| Finding::unknown(id, format!("probes cannot run: {why}")))
        .collect()
}

/// GEMM results must match the host reference this closely (relative). The inputs are small
/// integers, exact in FP32, so any real difference is a wrong result, not rounding.
pub const GEMM_TOLERANCE: f64 = 1e-4;

/// `judge`, then each GPU against its own baseline in `state_dir` (recorded from its first run
/// that passes every probe: `baseline`).
pub fn judge_here(report: &ProbeReport, targets: &[Target], state_dir: &std::path::Path) -> Vec<Finding> {
    let mut f = judge(report, targets);
    let b = baseline::apply(state_dir, report, targets, &f);
    f.extend(b);
    contended(report, &mut f);
    f
}

/// Probe checks that measure more than one GPU's own work: a process on any probed GPU
/// competes with them.
const ACROSS_GPUS: [&str; 4] = ["probe.p2p-bandwidth", "probe.latency", "probe.nvlink-scope", "probe.allreduce"];

/// What another process cannot cause: a wrong result in the probe's own buffers (a memory
/// mismatch, a wrong GEMM entry, a wrong all-reduce sum, either run), ECC counters that rose
/// under the test, or a sticky error that poisoned the GPU's context (an illegal address, an
/// uncorrectable ECC error: `sticky`). Another process competes for time, bandwidth and memory
/// (it may even take the memory a probe wanted); it cannot change what the probe's buffers
/// hold, the GPU's error counters, or make the GPU's context unusable.
fn wrong_result(f: &Finding, sticky: bool) -> bool {
    let positive = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64).is_some_and(|n| n > 0);
    let at = |key: &str, path: &[&str]| path.iter().try_fold(f.evidence.get(key)?, |v, k| v.get(*k));
    positive(at("memtest", &["mismatches"]))
        || positive(at("gemm", &["wrong_entries"]))
        || at("gemm", &["max_rel_error"]).and_then(serde_json::Value::as_f64).is_some_and(|e| e > GEMM_TOLERANCE)
        || positive(at("allreduce", &["nccl", "ok", "wrong_words"]))
        || positive(at("allreduce", &["nvls_off", "ok", "wrong_words"]))
        || f.evidence.contains_key("counters_after")
        || sticky
}

/// Whether any measurement of `g` ended in a sticky error (`ProbeError::Sticky`).
fn sticky(g: &GpuProbes) -> bool {
    let stuck = |e: &ProbeError| matches!(e, ProbeError::Sticky { .. });
    let err = |o: &Outcome<Stat>| matches!(o, Outcome::Error(e) if stuck(e));
    let gemm = |o: &Option<Outcome<GemmResult>>| matches!(o, Some(Outcome::Error(e)) if stuck(e));
    [&g.h2d_gbps, &g.d2h_gbps, &g.bidir_gbps, &g.d2d_gbps].into_iter().any(err)
        || g.sm_copy_gbps.as_ref().is_some_and(err)
        || g.host_latency_ns.as_ref().is_some_and(err)
        || matches!(&g.memory, Outcome::Error(e) if stuck(e))
        || matches!(&g.gemm, Outcome::Error(e) if stuck(e))
        || [&g.gemm_sustained, &g.gemm_fp64, &g.gemm_tensor, &g.gemm_tensor_fp16].into_iter().any(gemm)
}

/// A shortfall measured while another process used the GPU says nothing about the hardware
/// (issue 51): each warn or fail of a contended GPU (`GpuProbes::contended_by`; for the
/// checks across GPUs, of any probed GPU) becomes `unknown` and names the process, so it never
/// routes to the platform nor enters the fault history. A pass stays a pass: the GPU met its
/// floor even while shared. A wrong result stays a failure (`wrong_result`).
pub fn contended(report: &ProbeReport, findings: &mut [Finding]) {
    use crate::checks::Severity;
    let of_gpu = |pci: &str| -> Vec<&super::results::Contender> {
        report.gpus.iter().filter(|g| g.pci == pci).flat_map(|g| &g.contended_by).collect()
    };
    let all: Vec<&super::results::Contender> = report.gpus.iter().flat_map(|g| &g.contended_by).collect();
    for f in findings.iter_mut().filter(|f| f.id.starts_with("probe.")) {
        let stuck = report.gpus.iter().any(|g| f.gpu.as_deref() == Some(g.pci.as_str()) && sticky(g));
        if !matches!(f.severity, Severity::Warn | Severity::Fail) || wrong_result(f, stuck) {
            continue;
        }
        let by = match &f.gpu {
            Some(pci) if !ACROSS_GPUS.contains(&f.id.as_str()) => of_gpu(pci),
            _ => all.clone(),
        };
        let Some(first) = by.first() else { continue };
        let named: Vec<String> = by.iter().map(|c| c.to_string()).collect();
        f.detail = format!(
            "Measured: {} ({}). Another process used the GPU while it was probed: {}. A figure taken beside another job is that job's share as much as the hardware's, so it is not judged.\n{}",
            f.summary,
            f.severity.label().to_lowercase(),
            named.join("; "),
            f.detail
        )
        .trim_end()
        .to_string();
        f.summary = format!("not judged: another process used the GPU during the probe ({first})");
        f.severity = Severity::Unknown;
        f.remedy = Some("Probe again when the GPU is idle (the service runs its probes only then); nothing here says the hardware is at fault.".into());
        f.evidence.insert("contended_by".into(), serde_json::json!(by));
    }
}

/// Turns a report into `probe.*` findings against the floors of each GPU's SKU.
/// `contended` is applied by `judge_here`, after the baseline; a caller of this alone applies it.
pub fn judge(report: &ProbeReport, targets: &[Target]) -> Vec<Finding> {
    let mut out = Vec::new();
    let device_of = |pci: &str| targets.iter().find(|t| t.pci == pci).and_then(|t| t.device_id);
    let floors_of =
        |pci: &str| -> ProbeFloors { device_of(pci).map(facts::probe_floors).unwrap_or(facts::probe_floors(0)) };
    for s in &report.skipped {
        for id in crate::checks::CATALOG.iter().filter(|id| id.starts_with("probe.")) {
            out.push(Finding::unknown(id, format!("skipped: {}", s.reason)).gpu(&s.pci));
        }
    }
    for g in &report.gpus {
        let f = floors_of(&g.pci);
        let seen = |probe: &str| g.conditions.get(probe);
        out.push(
            beside(
                bandwidth_finding("probe.h2d-bandwidth", "host→device", &g.h2d_gbps, f.h2d_gbps, &g.pci),
                seen("h2d"),
            )
            .evidence("host_memory", &g.host_memory),
        );
        out.push(
            beside(
                bandwidth_finding("probe.d2h-bandwidth", "device→host", &g.d2h_gbps, f.d2h_gbps, &g.pci),
                seen("d2h"),
            )
            .evidence("host_memory", &g.host_memory),
        );
        // PCIe links are dual-simplex (PCIe Base Specification, "Link"): both directions at
        // once move at least what one direction does alone, so the bidirectional total is held
        // to the one-direction floor; less means a link or IOMMU path that serialises the two.
        let bidir_floor = f.h2d_gbps.zip(f.d2h_gbps).map(|(a, b)| a.min(b));
        out.push(beside(
            bandwidth_finding("probe.bidir-bandwidth", "both directions", &g.bidir_gbps, bidir_floor, &g.pci),
            seen("bidir"),
        ));
        out.push(beside(
            bandwidth_finding("probe.d2d-bandwidth", "device copy", &g.d2d_gbps, f.d2d_gbps, &g.pci),
            seen("d2d"),
        ));
        out.push(beside(
            ecc_across(memory_finding(&g.memory), seen("memory_before"), seen("memory")).gpu(&g.pci),
            seen("memory"),
        ));
        if let Some(sm) = &g.sm_copy_gbps {
            out.push(beside(
                bandwidth_finding("probe.sm-copy-bandwidth", "SM copy", sm, f.d2d_gbps, &g.pci),
                seen("sm_copy"),
            ));
        }
        if let Some(lat) = &g.host_latency_ns {
            out.push(latency_finding(report, g, lat));
        }
        out.push(beside(gemm_finding("probe.gemm", &g.gemm, f.gemm_tflops).gpu(&g.pci), seen("gemm")));
        if let Some(t) = &g.gemm_tensor {
            // No floor: NVIDIA's datasheets give the tensor cores' peak, which a plain kernel
            // does not approach; the GPU's own baseline judges the rate.
            out.push(beside(gemm_finding("probe.gemm-tensor", t, None).gpu(&g.pci), seen("gemm_tensor")));
        }
        if let Some(t) = &g.gemm_tensor_fp16 {
            let f = gemm_finding("probe.gemm-tensor-fp16", t, None);
            out.push(beside(f.gpu(&g.pci), seen("gemm_tensor_fp16")));
        }
        if let Some(s) = &g.gemm_sustained {
            let all = report.gpus.iter().filter(|x| x.gemm_sustained.is_some()).count();
            let f = gemm_finding("probe.gemm-sustained", s, f.gemm_tflops);
            let f = if f.severity == crate::checks::Severity::Pass {
                let secs = match s {
                    Outcome::Ok(r) => r.seconds,
                    Outcome::Error(_) => 0.0,
                };
                let summary = format!("{} — for {secs:.0} s with {all} GPU(s) loaded at once", f.summary);
                Finding { summary, ..f }
            } else {
                f
            };
            out.push(beside(f.gpu(&g.pci), seen("gemm_sustained")));
        }
        if let Some(d) = &g.gemm_fp64 {
            out.push(beside(gemm_finding("probe.gemm-fp64", d, None).gpu(&g.pci), seen("gemm_fp64")));
            out.extend(power_findings(g, d, device_of(&g.pci)));
        }
        // An H100 PCIe may have no bridge fitted: its pairs over PCIe are then no fault.
        let bridge_optional = device_of(&g.pci)
            .and_then(facts::nvlink_use)
            .is_some_and(|u| matches!(u, facts::NvlinkUse::Bridged { bridge_required: false, .. }));
        out.push(p2p_finding(report, g, f.p2p_gbps, bridge_optional));
    }
    if let Some(n) = &report.nvlink {
        out.push(scope_finding(report, n, &floors_of));
    }
    if let Some(a) = &report.allreduce {
        let ids: std::collections::BTreeSet<u16> =
            a.gpus.iter().filter_map(|pci| targets.iter().find(|t| &t.pci == pci)?.device_id).collect();
        // One SKU throughout, or no floor: Azure's figures are for a board of one SKU, at the
        // message that ran (smaller where the GPUs' memory was short).
        let bytes = match &a.nccl {
            Outcome::Ok(r) => r.bytes,
            Outcome::Error(_) => a.bytes,
        };
        let floor = match (ids.len(), ids.first()) {
            (1, Some(id)) => facts::allreduce_floor(*id, a.gpus.len(), bytes),
            _ => None,
        };
        out.push(allreduce_finding(report, a, floor));
        out.extend(nccl_start_finding(report, a));
    }
    out.extend(cublas_finding(report));
    out
}

/// `probe.power` and `probe.power-limit` for a GPU the FP64 load ran on: the highest board power
/// NVML read against DCGM's floor for its SKU (`facts::power_target_w` × `POWER_MIN_RATIO`), and
/// whether the limit the board enforces lets it get there at all.
fn power_findings(g: &GpuProbes, load: &Outcome<GemmResult>, device_id: Option<u16>) -> Vec<Finding> {
    let (power, limit) = ("probe.power", "probe.power-limit");
    let target = device_id.and_then(facts::power_target_w);
    let Some(run) = g.power.as_ref() else {
        let why = "no NVML beside the probes: the boards' power was not read";
        return vec![Finding::unknown(power, why).gpu(&g.pci), Finding::unknown(limit, why).gpu(&g.pci)];
    };
    let floor = target.map(|t| t * facts::POWER_MIN_RATIO);
    let limit_low = run.limit_w.zip(floor).is_some_and(|(l, f)| l <= f);
    let limit_finding = match (run.limit_w, floor) {
        (None, _) => Finding::unknown(limit, "NVML gave no enforced power limit"),
        (Some(l), None) => Finding::pass(limit, format!("enforced power limit {l:.0} W (DCGM gives this SKU no power target)")),
        (Some(l), Some(f)) if limit_low => Finding::warn(
            limit,
            format!("the enforced power limit is {l:.0} W, at or below the {f:.0} W the board must reach under load ({:.0} % of DCGM's {:.0} W target): the GPU is held below what its SKU delivers", facts::POWER_MIN_RATIO * 100.0, f / facts::POWER_MIN_RATIO),
        )
        .detail("NVML enforces the lower of the board's default limit and one set with `nvidia-smi -pl` (or NVML) since the driver loaded; in a passthrough VM only the guest sets it.")
        .remedy("Restore the default limit (`nvidia-smi -q -d POWER` shows it; `sudo nvidia-smi -i <GPU> -pl <default W>`) unless the limit is intended, then probe again."),
        (Some(l), Some(f)) => Finding::pass(limit, format!("enforced power limit {l:.0} W, above the {f:.0} W the power test asks")),
    };
    let stats = match (run.max_w, run.avg_w) {
        (Some(m), Some(a)) => format!("highest {m:.0} W, mean {a:.0} W over {} reading(s)", run.samples),
        _ => "no reading".into(),
    };
    let power_finding = match (load, run.max_w, floor) {
        (Outcome::Error(e), _, _) => Finding::unknown(power, format!("the FP64 load did not run: {e}")),
        (_, None, _) => Finding::unknown(
            power,
            format!("NVML gave no power reading: {}", run.error.as_deref().unwrap_or("none was taken")),
        ),
        (_, Some(_), None) => Finding::pass(power, format!("under FP64 load: {stats} (DCGM gives this SKU no power target: measured, not judged)")),
        (_, Some(m), Some(f)) if m >= f => {
            Finding::pass(power, format!("under FP64 load: {stats}, at least the {f:.0} W floor ({:.0} % of DCGM's {:.0} W target)", facts::POWER_MIN_RATIO * 100.0, f / facts::POWER_MIN_RATIO))
        }
        (_, Some(_), Some(f)) if limit_low => Finding::unknown(
            power,
            format!("under FP64 load: {stats}; not judged: the enforced power limit keeps the board below the {f:.0} W floor (probe.power-limit)"),
        ),
        (_, Some(_), Some(f)) => Finding::fail(
            power,
            format!("under FP64 load the board drew at most {stats}, short of the {f:.0} W floor ({:.0} % of DCGM's {:.0} W target), its limit {}", facts::POWER_MIN_RATIO * 100.0, f / facts::POWER_MIN_RATIO, run.limit_w.map_or("unknown".into(), |l| format!("{l:.0} W"))),
        )
        .detail("A GPU that cannot draw its SKU's power under a full GEMM load has a power-delivery fault (its power stage or the baseboard's supply) that a merely slow GEMM can hide; DCGM's targeted-power test fails it the same way.")
        .remedy("Drain the GPU and have the platform inspect its power delivery (by serial); probe again after a restart of the VM to rule out a transient cap."),
    };
    vec![
        power_finding.gpu(&g.pci).evidence("power", run).evidence("target_w", target).evidence("floor_w", floor),
        limit_finding.gpu(&g.pci).evidence("limit_w", run.limit_w).evidence("floor_w", floor),
    ]
}

/// Pairs of the all-reduce's GPUs that the peer probes found without peer access, "2↔6".
fn pairs_without_access(report: &ProbeReport, a: &AllReduce) -> Vec<String> {
    let ordinal_of = |pci: &String| report.gpus.iter().find(|g| &g.pci == pci).map(|g| g.ordinal);
    let members: Vec<usize> = a.gpus.iter().filter_map(ordinal_of).collect();
    report
        .peers
        .iter()
        .filter(|l| !l.peer_access && l.src < l.dst && members.contains(&l.src) && members.contains(&l.dst))
        .map(|l| format!("{}↔{}", l.src, l.dst))
        .collect()
}

/// `probe.nccl-start`: whether NCCL started its communicators. A start that fails with every
/// pair reachable is the guest's software (most often an NCCL built for a newer CUDA than the
/// driver supports: NCCL links the CUDA runtime statically), not the links; a pair without peer
/// access is the links' and `probe.allreduce` names it.
pub(crate) fn nccl_start_finding(report: &ProbeReport, a: &AllReduce) -> Option<Finding> {
    const ID: &str = "probe.nccl-start";
    let n = a.gpus.len();
    match &a.nccl {
        Outcome::Ok(r) => Some(Finding::pass(ID, format!("{} started on {n} GPUs", r.library))),
        Outcome::Error(ProbeError::NotStarted { error, library, driver_cuda, warning })
            if pairs_without_access(report, a).is_empty() =>
        {
            let said = warning.as_ref().map(|w| format!("NCCL's last warning: \"{w}\". ")).unwrap_or_default();
            Some(
                Finding::warn(ID, format!("{library} did not start its communicators on {n} GPUs: {error}"))
                    .detail(format!(
                        "{said}The driver supports CUDA {driver_cuda}. Every pair of these GPUs has peer access, so the \
                         links are not what stopped it: NCCL runs on a CUDA runtime of its own, which refuses a \
                         driver older than the CUDA it was built for (cudaErrorInsufficientDriver), and its \
                         other start failures are its configuration's."
                    ))
                    .remedy(
                        "Install the NCCL build for the CUDA this driver supports, or a driver for NCCL's CUDA \
                         (`phq-agent install` pairs them); run with NCCL_DEBUG=WARN to see NCCL's own reason.",
                    )
                    .evidence("nccl", library)
                    .evidence("driver_cuda", driver_cuda)
                    .evidence("nccl_warning", warning),
            )
        }
        Outcome::Error(_) => None,
    }
}

/// `probe.cublas`: whether the GEMMs could use the toolkit's cuBLAS, one finding per run. A
/// cuBLAS that loads but cannot start is the guest's software (a toolkit newer than the driver),
/// never the GPU's: the GEMMs ran on the agent's own kernels and are judged as such.
fn cublas_finding(report: &ProbeReport) -> Option<Finding> {
    const ID: &str = "probe.cublas";
    let ran: Vec<&GemmResult> = report
        .gpus
        .iter()
        .flat_map(|g| [Some(&g.gemm), g.gemm_tensor.as_ref(), g.gemm_tensor_fp16.as_ref(), g.gemm_sustained.as_ref()])
        .flatten()
        .filter_map(|o| match o {
            Outcome::Ok(r) => Some(r),
            Outcome::Error(_) => None,
        })
        .collect();
    if ran.is_empty() {
        return None;
    }
    if let Some(why) = ran.iter().find_map(|r| r.cublas_cannot_start.as_ref()) {
        return Some(
            Finding::warn(ID, "cuBLAS is installed but cannot start: the GEMM probes ran on the agent's own kernels")
                .detail(format!(
                    "{why}. cuBLAS starts a CUDA runtime of its own in cublasCreate, which refuses a driver older \
                     than the CUDA toolkit cuBLAS came with (cudaErrorInsufficientDriver). The GPUs were measured \
                     with the agent's kernels and are not at fault; an application using this cuBLAS would fail."
                ))
                .remedy(
                    "Install the CUDA toolkit (and its cuBLAS) that this driver supports, or a driver for the \
                     toolkit's CUDA (see cuda.toolkit-driver-compatible; `phq-agent install` pairs them).",
                )
                .evidence("cublas", why),
        );
    }
    Some(if ran.iter().any(|r| r.library.starts_with("cuBLAS")) {
        Finding::pass(ID, "cuBLAS started: the GEMMs ran through it")
    } else {
        Finding::pass(ID, "cuBLAS is not installed: the GEMMs ran on the agent's own kernels")
    })
}

/// `probe.allreduce`: the figure as NCCL chooses against Azure's floor for the board; the NVLS-off
/// figure beside it says where a shortfall lies.
pub(crate) fn allreduce_finding(report: &ProbeReport, a: &AllReduce, floor: Option<f64>) -> Finding {
    const ID: &str = "probe.allreduce";
    let n = a.gpus.len();
    let ring = match &a.nvls_off {
        Some(Outcome::Ok(r)) => Some(r.busbw_gbps.median),
        _ => None,
    };
    let no_access = pairs_without_access(report, a);
    let f = match &a.nccl {
        Outcome::Error(ProbeError::Unavailable(why)) => {
            Finding::unknown(ID, format!("all-reduce over {n} GPUs: {why}"))
        }
        Outcome::Error(ProbeError::NotStarted { error, .. }) if no_access.is_empty() => Finding::unknown(
            ID,
            format!("all-reduce over {n} GPUs not measured: NCCL did not start ({error}; see probe.nccl-start)"),
        ),
        Outcome::Error(e @ ProbeError::Hung { step, .. }) => {
            let why = if step.starts_with("ncclCommInitAll") {
                "NCCL did not finish starting: a start slower than `probes.nccl_allowance` (raise it if NCCL_DEBUG=INFO \
                 shows it progressing), or a GPU or path that does not answer."
            } else if step.contains("all-reduce") {
                "NCCL waits for ever when a path that reports peer access does not carry its traffic: PCIe ACS or \
                 the VM's IOMMU dropping peer writes (NCCL's troubleshooting guide, \"PCI Access Control Services\"; \
                 NVIDIA/nccl#2079, #257), or a GPU that stopped answering. A training job on these GPUs would hang \
                 the same way."
            } else {
                "A step of the all-reduce's process never returned: a GPU that stopped answering (Xid 79, 119) or a \
                 synchronisation that never ends."
            };
            Finding::fail(ID, format!("NCCL's all-reduce over {n} GPUs {e}"))
                .detail(format!("{why} The all-reduce process was killed."))
                .remedy(
                    "Read `dmesg | grep -E 'NVRM|Xid|DMAR|AMD-Vi'` for GPU and IOMMU faults; ask the platform whether \
                     P2P between these GPUs is supported in this VM (NCCL_P2P_DISABLE=1 lets a job run, slowly).",
                )
        }
        Outcome::Error(e) => {
            let f = Finding::fail(ID, format!("NCCL's all-reduce over {n} GPUs failed: {e}"));
            if no_access.is_empty() {
                f.remedy("Run with NCCL_DEBUG=WARN to see NCCL's reason; read `dmesg | grep -E 'NVRM|Xid'`.")
            } else {
                f.detail(format!(
                    "GPUs {} have no peer access. Between GPUs joined by NVLink NCCL refuses to start without P2P \
                     (\"P2P is disabled between NVLINK connected GPUs\", NCCL's src/graph/paths.cc): a fault of the \
                     links, the fabric or the VM's passthrough, not of NCCL.",
                    no_access.join(", ")
                ))
                .remedy(
                    "Check nvlink.links-active, fabric.state and the peer probes; ask the platform about P2P in this \
                     VM. NCCL_IGNORE_DISABLED_P2P=1 lets NCCL run those pairs through host memory, slowly.",
                )
            }
        }
        Outcome::Ok(r) if r.wrong_words > 0 => Finding::fail(
            ID,
            format!(
                "NCCL's all-reduce over {n} GPUs gave a wrong sum: {} of {} words ({})",
                r.wrong_words,
                r.checked_words,
                r.first_wrong.as_deref().unwrap_or("first not kept")
            ),
        )
        .detail("Every element should be n(n+1)/2, exact in FP32: data was corrupted between or on the GPUs.")
        .remedy("Check nvlink.errors and gpu.ecc; restart the VM; report the GPUs to the platform."),
        Outcome::Ok(r) => {
            let v = r.busbw_gbps.median;
            let ring_text = ring.map(|g| format!("; with NVLS off {g:.1}")).unwrap_or_default();
            let head = format!("all-reduce over {n} GPUs: {v:.1} GB/s bus bandwidth{ring_text}");
            match floor {
                Some(fl) if v < fl => {
                    // NVLS that adds nothing over the rings: the NVSwitches' reductions are not
                    // in use. NVLS in use and still short: a link or a GPU is slow.
                    let multicast = if r.multicast == Some(false) {
                        " The GPUs report no switch multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0), so \
                         NCCL does not enable NVLS at all."
                    } else {
                        ""
                    };
                    let why = match ring {
                        Some(g) if g >= 0.95 * v => format!(
                            "With NVLS off NCCL's other algorithms (ring or tree) reach {g:.1} GB/s, as much as its \
                            own choice: NVLink SHARP on the NVSwitches is not helping, so the fabric (its multicast, \
                            the fabric manager) is where to look, not the links.{multicast}"
                        ),
                        Some(g) if r.multicast != Some(false) => format!(
                            "NCCL's choice beats its other algorithms ({g:.1} GB/s with NVLS off), so NVLS is in use \
                            and still short: a slow link or GPU holds every algorithm back (see probe.p2p-bandwidth)."
                        ),
                        Some(g) => format!(
                            "NCCL's choice beats its other algorithms ({g:.1} GB/s with NVLS off) and is still short: \
                            a slow link or GPU holds every algorithm back (see probe.p2p-bandwidth).{multicast}"
                        ),
                        None => multicast.trim_start().to_string(),
                    };
                    let set: Vec<String> =
                        r.settings.iter().filter(|s| s.name != "NCCL_NVLS_ENABLE").map(|s| s.to_string()).collect();
                    let why = if set.is_empty() {
                        why
                    } else {
                        format!("{why} NCCL ran with these settings, which may explain it: {}.", set.join(", "))
                    };
                    let why = if no_access.is_empty() {
                        why
                    } else {
                        format!(
                            "GPUs {} have no peer access: NCCL carries those pairs through host memory (its SHM \
                             transport), and every ring through them is held to that rate. {why}",
                            no_access.join(", ")
                        )
                    };
                    Finding::fail(ID, format!("{head}, below the floor of {fl:.0} GB/s"))
                        .detail(why.trim_end().to_string())
                        .remedy(
                            "Check fabric.state and the fabric manager (NVSwitch SXids), nvlink.links-active and \
                        nvlink.errors; restart the VM; report the board to the platform with these figures.",
                        )
                }
                Some(fl) => Finding::pass(ID, format!("{head} (floor {fl:.0})")),
                None => Finding::pass(
                    ID,
                    format!(
                        "{head} (no published floor for {n} GPUs of this SKU at {} MiB messages: the baseline judges)",
                        r.bytes >> 20
                    ),
                ),
            }
        }
    };
    f.evidence("allreduce", a).evidence("floor_gbps", floor)
}

/// The NVLink scope in one line a person reads — "8 GPUs, all-to-all over NVLink through
/// NVSwitch, 18 links each, 56/56 pairs ≥ 335 GB/s (fabric completed, clique 1)". An account,
/// not a judgement: the pairs are judged by `probe.p2p-bandwidth`, the fabric by doctor's
/// `fabric.state`.
fn scope_finding(report: &ProbeReport, n: &NvlinkScope, floors_of: &dyn Fn(&str) -> ProbeFloors) -> Finding {
    const ID: &str = "probe.nvlink-scope";
    let mut text = format!("{} GPU(s)", n.gpus);
    if n.gpus < 2 {
        text.push_str(": no peers to reach");
    } else if n.nvlink_pairs == 0 {
        text.push_str(": no NVLink between them (peer copies over PCIe or none)");
    } else {
        let reach = if n.nvlink_pairs == n.pairs {
            "all-to-all over NVLink".to_string()
        } else {
            format!("{} of {} pairs over NVLink", n.nvlink_pairs, n.pairs)
        };
        let through = match n.through.as_str() {
            "NVSwitch" => " through NVSwitch",
            "direct" => " by direct bridges",
            "mixed" => " through NVSwitch and bridges",
            _ => "",
        };
        let counts: std::collections::BTreeSet<usize> = n.links.values().copied().collect();
        let links = match (counts.first(), counts.last()) {
            (Some(a), Some(b)) if a == b => format!("{a} links each"),
            (Some(a), Some(b)) => format!("{a}–{b} links per GPU"),
            _ => "no link states".to_string(),
        };
        text.push_str(&format!(", {reach}{through}, {links}"));
        let nv: Vec<&PeerLink> = report.peers.iter().filter(|l| l.scope == "nvlink").collect();
        let floor = report.gpus.first().and_then(|g| floors_of(&g.pci).p2p_gbps);
        let ok = nv
            .iter()
            .filter(|l| match (&l.gbps, floor) {
                (Some(Outcome::Ok(s)), Some(fl)) => s.median >= fl,
                (Some(Outcome::Ok(_)), None) => true,
                _ => false,
            })
            .count();
        match floor {
            Some(fl) => text.push_str(&format!(", {ok}/{} pairs ≥ {fl:.0} GB/s", nv.len())),
            None => text.push_str(&format!(", {ok}/{} pairs measured (no floor for this SKU)", nv.len())),
        }
    }
    let fabrics: std::collections::BTreeSet<&String> = n.fabric.values().collect();
    match fabrics.len() {
        0 => {}
        1 => text.push_str(&format!(" (fabric {})", fabrics.iter().next().map(|s| s.as_str()).unwrap_or(""))),
        _ => text.push_str(" (fabric states differ between GPUs: see the evidence)"),
    }
    Finding::pass(ID, text).evidence("nvlink", n)
}

/// NVML's reading after the measurement goes into the evidence; a figure that failed while the
/// GPU was held back (thermal, power or hardware slowdown) says so, since then the GPU, not the
/// link, may be what is slow.
fn beside(f: Finding, seen: Option<&Conditions>) -> Finding {
    let Some(c) = seen else { return f };
    let held = c.held_back();
    let f = if f.severity == crate::checks::Severity::Fail && !held.is_empty() {
        let why = format!(
            "Right after this measurement NVML reported the GPU held back ({}; SM clock {} MHz): the figure may be the GPU's throttling rather than the path's.",
            held.join(", "),
            c.sm_clock_mhz.map(|m| m.to_string()).unwrap_or_else(|| "?".into())
        );
        let detail = if f.detail.is_empty() { why } else { format!("{} {why}", f.detail) };
        f.detail(detail)
    } else {
        f
    };
    f.evidence("conditions", c)
}

fn bandwidth_finding(id: &str, what: &str, o: &Outcome<Stat>, floor: Option<f64>, pci: &str) -> Finding {
    let f = match (o, floor) {
        (Outcome::Error(ProbeError::Unavailable(why)), _) => Finding::unknown(id, format!("{what}: {why}")),
        (Outcome::Error(e), _) if is_ecc(e) => Finding::unknown(id, format!("{what}: stopped by an uncorrectable ECC error on this GPU (see probe.memory-integrity): {e}")),
        (Outcome::Error(e), _) => Finding::fail(id, format!("{what} copy failed: {e}")).remedy("Read `dmesg | grep NVRM` (an Xid during the copy?); restart the VM and probe again."),
        (Outcome::Ok(s), Some(fl)) if s.median < fl => Finding::fail(id, format!("{what} {:.1} GB/s, below the floor of {fl:.0} GB/s", s.median))
            .detail(if id == "probe.d2d-bandwidth" { "Device memory bandwidth this low means a throttled or faulty GPU (see gpu.throttle, gpu.temperature)." } else { "The PCIe link carries less than the SKU should: a degraded link (width or generation), a busy host, or a NUMA-remote pinned buffer." })
            .remedy("Check gpu.pcie-link and gpu.throttle; probe again with nothing else running; if it stays low, report the GPU to the platform with this figure."),
        (Outcome::Ok(s), Some(fl)) => Finding::pass(id, format!("{what} {:.1} GB/s (floor {fl:.0})", s.median)),
        (Outcome::Ok(s), None) => Finding::pass(id, format!("{what} {:.1} GB/s (no floor for this SKU)", s.median)),
    };
    let f = match o {
        Outcome::Ok(s) => f.evidence("median_gbps", s.median).evidence("samples_gbps", &s.samples),
        Outcome::Error(_) => f,
    };
    f.gpu(pci).evidence("floor_gbps", floor)
}

/// A rise of NVML's ECC or row-remap counters across the memory test is a finding even when
/// every word read back right: the GPU corrected (or could not correct) errors while it ran.
pub(super) fn ecc_across(f: Finding, before: Option<&Conditions>, after: Option<&Conditions>) -> Finding {
    use crate::checks::Severity;
    let (Some(b), Some(a)) = (before, after) else { return f };
    let rise = |x: u64, y: u64| y.saturating_sub(x);
    let mut fail = Vec::new();
    let mut warn = Vec::new();
    if let (Some(x), Some(y)) = (&b.ecc_volatile, &a.ecc_volatile) {
        if rise(x.uncorrected, y.uncorrected) > 0 {
            fail.push(format!("{} uncorrectable ECC error(s)", rise(x.uncorrected, y.uncorrected)));
        }
        if rise(x.corrected, y.corrected) > 0 {
            warn.push(format!("{} corrected ECC error(s)", rise(x.corrected, y.corrected)));
        }
    }
    if let (Some(x), Some(y)) = (&b.remapped_rows, &a.remapped_rows) {
        let (u, c) =
            (rise(x.uncorrectable.into(), y.uncorrectable.into()), rise(x.correctable.into(), y.correctable.into()));
        if u > 0 {
            fail.push(format!("{u} row(s) remapped for uncorrectable errors"));
        }
        if c > 0 {
            warn.push(format!("{c} row(s) remapped for correctable errors"));
        }
        if y.pending && !x.pending {
            warn.push("a row remap pending (applied at the next GPU reset)".into());
        }
    }
    if fail.is_empty() && warn.is_empty() {
        return f;
    }
    let what = fail.iter().chain(&warn).cloned().collect::<Vec<_>>().join(", ");
    let text = format!("NVML counted {what} while the memory test ran");
    let severity = if fail.is_empty() { Severity::Warn } else { Severity::Fail };
    let f = if f.severity == Severity::Pass || (severity == Severity::Fail && f.severity != Severity::Fail) {
        let summary = if f.severity == Severity::Pass { format!("{} — but {text}", f.summary) } else { text.clone() };
        let base =
            if severity == Severity::Fail { Finding::fail(&f.id, summary) } else { Finding::warn(&f.id, summary) };
        let mut base = base
            .detail("Every word read back right, but the GPU's memory needed error correction (or failed it) under the test's load: memory that is wearing out.")
            .remedy("Check gpu.ecc-uncorrectable and gpu.row-remap; drain the GPU, reset it (restart the VM) and probe again; report it to the platform if the counters keep rising.");
        base.evidence = f.evidence.clone();
        base
    } else {
        let detail = if f.detail.is_empty() { format!("{text}.") } else { format!("{} {text}.", f.detail) };
        f.detail(detail)
    };
    f.evidence("counters_before", b).evidence("counters_after", a)
}

/// Host↔device latency (and the peers' in the evidence): no published floor, so the figure is
/// reported, kept in the baseline and judged by its drift (`probe.baseline`).
fn latency_finding(report: &ProbeReport, g: &GpuProbes, o: &Outcome<Stat>) -> Finding {
    const ID: &str = "probe.latency";
    let peers: Vec<serde_json::Value> = report
        .peers
        .iter()
        .filter(|l| l.src == g.ordinal)
        .filter_map(|l| match &l.latency_ns {
            Some(Outcome::Ok(s)) => Some(serde_json::json!({"dst": l.dst, "scope": l.scope, "median_ns": s.median})),
            _ => None,
        })
        .collect();
    let f = match o {
        Outcome::Error(ProbeError::Unavailable(why)) => Finding::unknown(ID, why.clone()),
        Outcome::Error(e) if is_ecc(e) => Finding::unknown(
            ID,
            format!("stopped by an uncorrectable ECC error on this GPU (see probe.memory-integrity): {e}"),
        ),
        Outcome::Error(e) => Finding::fail(ID, format!("latency probe failed: {e}"))
            .remedy("Read `dmesg | grep NVRM`; restart the VM and probe again."),
        Outcome::Ok(s) => {
            let slowest = peers
                .iter()
                .filter_map(|p| p["median_ns"].as_f64())
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
            let peer_text = slowest.map(|v| format!("; slowest peer {:.2} µs", v / 1000.0)).unwrap_or_default();
            Finding::pass(
                ID,
                format!("host memory {:.2} µs per dependent load from the GPU{peer_text}", s.median / 1000.0),
            )
            .evidence("median_ns", s.median)
            .evidence("samples_ns", &s.samples)
        }
    };
    f.gpu(&g.pci).evidence("peers", &peers)
}

pub(super) fn memory_finding(o: &Outcome<MemtestResult>) -> Finding {
    const ID: &str = "probe.memory-integrity";
    match o {
        Outcome::Error(ProbeError::Unavailable(why)) => Finding::unknown(ID, why.clone()),
        // DCGM's memory test maps an uncorrectable ECC error met while testing to a memory
        // failure of the GPU, not to a test that could not run.
        Outcome::Error(ProbeError::Sticky { code: crate::cuda::code::ECC_UNCORRECTABLE, message, .. }) => {
            Finding::fail(ID, format!("uncorrectable ECC error (CUDA error 214) while probing this GPU ({message})"))
                .detail("The GPU's memory returned data ECC could not correct; the GPU is unusable until it is reset.")
                .remedy("Drain the GPU, check gpu.ecc-uncorrectable and gpu.row-remap, reset it (restart the VM) and probe again; if it repeats, report it to the platform for replacement.")
        }
        Outcome::Error(e) => Finding::fail(ID, format!("memory test failed to run: {e}"))
            .remedy("Read `dmesg | grep NVRM`; restart the VM and probe again."),
        Outcome::Ok(m) if m.mismatches == 0 => Finding::pass(
            ID,
            format!(
                "{} MiB written and checked with {} pattern(s){}, no mismatch",
                m.bytes_tested >> 20,
                m.patterns.len(),
                if m.method == "kernels" { " on the GPU" } else { " (read back to the host: the probe kernels could not load)" }
            ),
        )
        .evidence("memtest", m),
        Outcome::Ok(m) => {
            let first = m.passes.iter().find_map(|p| p.first.first().map(|x| (p, x)));
            let at = match (first, &m.first_mismatch) {
                (Some((p, x)), _) => {
                    let bits: Vec<String> =
                        (0..64).filter(|b| (x.read ^ x.expected) >> b & 1 == 1).map(|b: u32| b.to_string()).collect();
                    format!(
                        " (lowest of the {} kept in {}: device address {:#x} read {:#018x}, expected {:#018x}; bit(s) {} differ)",
                        p.first.len(),
                        p.name,
                        x.address,
                        x.read,
                        x.expected,
                        bits.join(", ")
                    )
                }
                (None, Some((o, v))) => format!(" (first at byte offset {o:#x}: read {v})"),
                (None, None) => String::new(),
            };
            let by_pass: Vec<String> =
                m.passes.iter().filter(|p| p.mismatches > 0).map(|p| format!("{} {}", p.name, p.mismatches)).collect();
            let by_pass = if by_pass.is_empty() { String::new() } else { format!(": {}", by_pass.join(", ")) };
            Finding::fail(ID, format!("{} mismatching word(s) in {} MiB{by_pass}{at}", m.mismatches, m.bytes_tested >> 20))
                .detail("The GPU returned different data than was written: its memory is corrupting data.")
                .remedy("Drain the GPU, check gpu.ecc-uncorrectable and gpu.row-remap, reset it (restart the VM) and probe again; if mismatches remain, report it to the platform for replacement.")
                .evidence("memtest", m)
        }
    }
}

fn gemm_finding(id: &str, o: &Outcome<GemmResult>, floor: Option<f64>) -> Finding {
    #[allow(non_snake_case)]
    let ID = id;
    match o {
        Outcome::Error(ProbeError::Unavailable(why)) => Finding::unknown(ID, why.clone()),
        Outcome::Error(e) if is_ecc(e) => Finding::unknown(
            ID,
            format!("stopped by an uncorrectable ECC error on this GPU (see probe.memory-integrity): {e}"),
        ),
        Outcome::Error(e) => Finding::fail(ID, format!("GEMM failed to run: {e}"))
            .remedy("Read `dmesg | grep NVRM`; restart the VM and probe again."),
        Outcome::Ok(g) => {
            let tflops = Stat::of(g.tflops_samples.clone()).map(|s| s.median).unwrap_or(0.0);
            // DCGM's floors are cuBLAS's figures; the agent's own fallback kernel is checked for
            // right results only.
            let fallback = [gemm::PTX_GEMM, gemm::PTX_MMA_GEMM, gemm::PTX_MMA_FP16_GEMM, gemm::PTX_DGEMM]
                .contains(&g.library.as_str());
            let fp64 = g.library == gemm::PTX_DGEMM || g.library == gemm::CUBLAS_DGEMM;
            let fp16 = g.library == gemm::PTX_MMA_FP16_GEMM || g.library == gemm::CUBLAS_FP16_GEMM;
            let tensor = fp16 || g.library == gemm::PTX_MMA_GEMM || g.library == gemm::CUBLAS_BF16_GEMM;
            let kind = match (tensor, fp16, fp64) {
                (true, true, _) => "FP16 tensor-core GEMM",
                (true, false, _) => "BF16 tensor-core GEMM",
                (_, _, true) => "FP64 GEMM",
                _ => "FP32 GEMM",
            };
            // DCGM's floors are FP32 figures: a tensor-core or FP64 rate has none (the baseline
            // holds the former; the power test judges the latter's load).
            let floor = floor.filter(|_| !fallback && !tensor && !fp64);
            let f = if g.wrong_entries > 0 || g.max_rel_error > GEMM_TOLERANCE {
                let first = g.first_wrong.as_ref().map(|w| format!("; first {w}")).unwrap_or_default();
                Finding::fail(ID, format!("{kind} {n}×{n} gave wrong results: {} of {} checked entries differ (largest relative error {:.2e}{first})", g.wrong_entries, g.checked_entries, g.max_rel_error, n = g.n))
                    .detail("The GPU computed a different product than the host: a faulty GPU (compute or memory).")
                    .remedy("Drain the GPU, reset it (restart the VM) and probe again; report it to the platform if it repeats.")
            } else if let Some(fl) = floor.filter(|fl| tflops < *fl) {
                Finding::fail(ID, format!("{kind} {n}×{n}: {tflops:.1} TFLOP/s, below the floor of {fl:.1}", n = g.n))
                    .detail("The result was right but the GPU computes slower than its SKU sustains: clocks held down (power, heat) or a GPU shared with other work.")
                    .remedy("Check gpu.throttle, gpu.temperature and gpu.power; probe again with nothing else running; report the GPU to the platform if it stays low.")
            } else {
                let against = match (floor, fallback) {
                    (Some(fl), _) => format!(" (floor {fl:.1})"),
                    (None, true) => " by the agent's PTX kernel (no cuBLAS here: no floor applies)".into(),
                    (None, false) if tensor => " (no published floor: held to this GPU's baseline)".into(),
                    (None, false) => String::new(),
                };
                let how = if g.checked_on == "device" {
                    format!(
                        "every entry of every timed result checked exactly on the GPU ({} entries)",
                        g.checked_entries
                    )
                } else {
                    format!("every timed result checked exactly on {} entries", g.checked_entries)
                };
                Finding::pass(ID, format!("{kind} {n}×{n}: {tflops:.1} TFLOP/s{against}, {how}", n = g.n))
            };
            f.evidence("gemm", g).evidence("median_tflops", tflops).evidence("floor_tflops", floor)
        }
    }
}

fn p2p_finding(report: &ProbeReport, g: &GpuProbes, floor: Option<f64>, bridge_optional: bool) -> Finding {
    const ID: &str = "probe.p2p-bandwidth";
    let row: Vec<&PeerLink> = report.peers.iter().filter(|l| l.src == g.ordinal).collect();
    if row.is_empty() {
        return Finding::pass(ID, "no other GPU probed: no peer copies").gpu(&g.pci);
    }
    // A pair not measured because one of its GPUs was lost says nothing about the link.
    let lost = |l: &PeerLink| matches!(l.gbps, Some(Outcome::Error(ProbeError::Unavailable(_))));
    let reach =
        |scope: &str| -> Vec<usize> { row.iter().filter(|l| l.scope == scope && !lost(l)).map(|l| l.dst).collect() };
    let (nvlink, pcie, none) = (reach("nvlink"), reach("pcie"), reach("none"));
    let slowest_of = |scope: Option<&str>| {
        row.iter()
            .filter(|l| scope.is_none_or(|s| l.scope == s))
            .filter_map(|l| match &l.gbps {
                Some(Outcome::Ok(s)) => Some((l.dst, s.median)),
                _ => None,
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
    };
    let (slowest, slowest_nvlink) = (slowest_of(None), slowest_of(Some("nvlink")));
    let scope = format!("NVLink to {:?}, PCIe only to {:?}, no peer access to {:?}", nvlink, pcie, none);
    let errors: Vec<String> = row
        .iter()
        .filter_map(|l| match &l.gbps {
            Some(Outcome::Error(ProbeError::Unavailable(_))) => None,
            Some(Outcome::Error(e)) => Some(format!("→ GPU {}: {e}", l.dst)),
            _ => None,
        })
        .collect();
    // Pairs with a GPU that became unusable (a sticky error) are not this GPU's failure.
    let unmeasured: Vec<String> = row
        .iter()
        .filter_map(|l| match &l.gbps {
            Some(Outcome::Error(ProbeError::Unavailable(why))) => Some(format!("→ GPU {}: {why}", l.dst)),
            _ => None,
        })
        .collect();
    let scope = if unmeasured.is_empty() { scope } else { format!("{scope}; {}", unmeasured.join("; ")) };
    let measured = row.iter().any(|l| matches!(l.gbps, Some(Outcome::Ok(_))) || !l.peer_access && l.gbps.is_none());
    let f = if errors.is_empty() && !measured && !unmeasured.is_empty() {
        Finding::unknown(ID, "no peer copy measured").detail(scope.clone())
    } else if !errors.is_empty() {
        Finding::fail(ID, format!("peer copies failed: {}", errors.join("; ")))
            .remedy("Restart the VM; check nvlink.links-active and fabric.state.")
    } else {
        match (floor, slowest_nvlink) {
            (Some(fl), Some((dst, v))) if v < fl => Finding::fail(ID, format!("slowest NVLink peer copy {v:.0} GB/s (to GPU {dst}), below the floor of {fl:.0} GB/s"))
                .detail(scope.clone())
                .remedy("Check nvlink.links-active and nvlink.errors for the pair; restart the VM; report the GPUs to the platform if it stays low."),
            (Some(fl), _) if !bridge_optional && (!pcie.is_empty() || !none.is_empty()) => {
                let without: Vec<usize> = pcie.iter().chain(&none).copied().collect();
                let summary = if nvlink.is_empty() {
                    "no NVLink between these GPUs in this VM".to_string()
                } else {
                    format!("no NVLink to GPU(s) {without:?} in this VM")
                };
                Finding::warn(ID, summary)
                    .detail(format!("{scope}. This SKU's pairs reach {fl:.0} GB/s and more over NVLink; without it collectives crawl over PCIe."))
                    .remedy("If the VM should have NVLink: pass the NVSwitches through (or have the host's fabric manager share them) and check fabric.state.")
            }
            _ => match slowest {
                Some((dst, v)) => Finding::pass(ID, format!("slowest peer copy {v:.0} GB/s (to GPU {dst})")).detail(scope.clone()),
                None => Finding::pass(ID, "no peer access between these GPUs (reported, no floor for this SKU)").detail(scope.clone()),
            },
        }
    };
    f.gpu(&g.pci).evidence("nvlink_to", nvlink).evidence("pcie_to", pcie).evidence("no_access_to", none)
}
