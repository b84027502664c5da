//! Each GPU's own baseline: the figures of its first probe run that passed every check, kept in
//! the state directory by GPU serial (or UUID) and level. Later runs compare against it, so a
//! GPU that slowly loses bandwidth or gains latency — a link retrained narrower after a host
//! reboot, a host whose memory moved away — is told apart while it is still above its floor.
//!
//! The thresholds are our choice, not published figures: a bandwidth or GEMM figure more than
//! 10% below the GPU's baseline, or a latency more than 25% above it, is a warning. Repeated
//! runs of a healthy GPU differ by a few percent (nvbandwidth's samples do), and latency, a
//! figure of a microsecond, moves more than bandwidth does.

use super::{GpuProbes, Outcome, ProbeReport, Target};
use crate::checks::{Finding, Severity};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

pub const FILE: &str = "probe-baseline.json";
const ID: &str = "probe.baseline";
/// A bandwidth or GEMM figure this far below its baseline is a warning.
pub const SLOWER: f64 = 0.10;
/// A latency this far above its baseline is a warning.
pub const LATER: f64 = 0.25;
/// A baseline file larger than this is not one the agent wrote.
const MAX_BYTES: u64 = 4 << 20;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Baselines {
    /// GPU serial (or UUID) → level → its baseline.
    pub gpus: BTreeMap<String, BTreeMap<String, Baseline>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub pci: String,
    pub recorded_at: String,
    /// Figure name → value: `*_gbps` and `*_tflops` (higher is better), `*_ns` (lower is).
    pub figures: BTreeMap<String, f64>,
}

/// The figures of one GPU's run worth keeping; the all-reduce's bus bandwidth goes to each GPU
/// that took part, named by how many did and the message that ran
/// (`allreduce_8gpu_16384mib_busbw_gbps`): bus bandwidth grows with the message until the links
/// are full, so a figure of another number of GPUs or another size is another figure.
pub fn figures(g: &GpuProbes, report: &ProbeReport) -> BTreeMap<String, f64> {
    let peers = &report.peers;
    let mut m = BTreeMap::new();
    if let Some(a) = report.allreduce.as_ref().filter(|a| a.gpus.contains(&g.pci)) {
        if let Outcome::Ok(r) = &a.nccl {
            m.insert(format!("allreduce_{}gpu_{}mib_busbw_gbps", a.gpus.len(), r.bytes >> 20), r.busbw_gbps.median);
        }
    }
    let mut put = |name: &str, o: Option<&Outcome<super::Stat>>| {
        if let Some(Outcome::Ok(s)) = o {
            m.insert(name.to_string(), s.median);
        }
    };
    put("h2d_gbps", Some(&g.h2d_gbps));
    put("d2h_gbps", Some(&g.d2h_gbps));
    put("bidir_gbps", Some(&g.bidir_gbps));
    put("d2d_gbps", Some(&g.d2d_gbps));
    put("sm_copy_gbps", g.sm_copy_gbps.as_ref());
    put("host_latency_ns", g.host_latency_ns.as_ref());
    for (name, o) in [
        ("gemm", Some(&g.gemm)),
        ("gemm_tensor", g.gemm_tensor.as_ref()),
        ("gemm_tensor_fp16", g.gemm_tensor_fp16.as_ref()),
    ] {
        if let Some(Outcome::Ok(gm)) = o {
            if let Some(s) = super::Stat::of(gm.tflops_samples.clone()) {
                m.insert(gemm_figure(name, &gm.library), s.median);
            }
        }
    }
    let mine = peers.iter().filter(|l| l.src == g.ordinal);
    let slowest = mine
        .clone()
        .filter_map(|l| match &l.gbps {
            Some(Outcome::Ok(s)) => Some(s.median),
            _ => None,
        })
        .fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.min(v))));
    if let Some(v) = slowest {
        m.insert("p2p_slowest_gbps".into(), v);
    }
    let latest = mine
        .filter_map(|l| match &l.latency_ns {
            Some(Outcome::Ok(s)) => Some(s.median),
            _ => None,
        })
        .fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    if let Some(v) = latest {
        m.insert("p2p_latency_ns".into(), v);
    }
    m
}

/// A GEMM figure's name: `gemm_tflops` by cuBLAS, `gemm_ptx_tflops` by the agent's own kernels.
/// They are two figures, never one: on an H200 the agent's kernels ran at a small part of
/// cuBLAS's rate (FP32 8.1 against 50.9 TFLOP/s, BF16 19.6 against 794; docs/hardware-validation.md),
/// so a run without cuBLAS compared with a baseline made with it read as a GPU that lost 97%.
fn gemm_figure(name: &str, library: &str) -> String {
    if library.starts_with("cuBLAS") {
        format!("{name}_tflops")
    } else {
        format!("{name}_ptx_tflops")
    }
}

/// The figures that moved the wrong way past the thresholds: (name, baseline, now, change).
pub fn drift(base: &BTreeMap<String, f64>, now: &BTreeMap<String, f64>) -> Vec<(String, f64, f64, f64)> {
    let mut out = Vec::new();
    for (name, b) in base {
        let Some(n) = now.get(name) else { continue };
        if *b <= 0.0 {
            continue;
        }
        let change = (n - b) / b;
        let worse = if name.ends_with("_ns") { change > LATER } else { change < -SLOWER };
        if worse {
            out.push((name.clone(), *b, *n, change));
        }
    }
    out
}

fn label(name: &str) -> String {
    if let Some(cublas) = name.strip_suffix("_ptx_tflops") {
        return label(&format!("{cublas}_tflops")).replacen(" (", " by the agent's own kernel (", 1);
    }
    let (what, unit) = match name {
        "h2d_gbps" => ("host→device", "GB/s"),
        "d2h_gbps" => ("device→host", "GB/s"),
        "bidir_gbps" => ("both directions", "GB/s"),
        "d2d_gbps" => ("device copy", "GB/s"),
        "sm_copy_gbps" => ("SM copy", "GB/s"),
        "gemm_tflops" => ("GEMM", "TFLOP/s"),
        "gemm_tensor_tflops" => ("tensor-core GEMM", "TFLOP/s"),
        "gemm_tensor_fp16_tflops" => ("FP16 tensor-core GEMM", "TFLOP/s"),
        "host_latency_ns" => ("host latency", "ns"),
        "p2p_slowest_gbps" => ("slowest peer copy", "GB/s"),
        "p2p_latency_ns" => ("slowest peer latency", "ns"),
        other if other.starts_with("allreduce_") => ("all-reduce bus bandwidth", "GB/s"),
        other => (other, ""),
    };
    format!("{what} ({unit})")
}

/// Reads the baselines; a missing file is none yet. Anything but a regular file the agent could
/// have written is an error naming the file, and the file is left as it is.
pub fn load(path: &Path) -> Result<Baselines, String> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Baselines::default()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if !meta.is_file() {
        return Err(format!("{}: not a regular file", path.display()));
    }
    if meta.len() > MAX_BYTES {
        return Err(format!("{}: {} bytes, larger than any baseline the agent writes", path.display(), meta.len()));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: not a baseline file ({e})", path.display()))
}

/// Compares each probed GPU with its baseline (`probe.baseline`), and records one for every GPU
/// that has none at this level and passed every probe check in `findings`.
pub fn apply(state_dir: &Path, report: &ProbeReport, targets: &[Target], findings: &[Finding]) -> Vec<Finding> {
    let path = state_dir.join(FILE);
    let level = format!("{:?}", report.level).to_lowercase();
    let mut base = match load(&path) {
        Ok(b) => b,
        Err(e) => {
            return report
                .gpus
                .iter()
                .map(|g| {
                    Finding::unknown(ID, format!("the baseline cannot be read: {e}"))
                        .remedy(format!("Move {} aside (the agent then records a new baseline).", path.display()))
                        .gpu(&g.pci)
                })
                .collect();
        }
    };
    let now = crate::snapshot::Timestamp::now().to_string();
    let mut changed = false;
    let mut out = Vec::new();
    for g in &report.gpus {
        let Some(key) = targets.iter().find(|t| t.pci == g.pci).and_then(|t| t.serial.clone()) else {
            out.push(
                Finding::unknown(ID, "NVML gives this GPU no serial number or UUID: no baseline to keep").gpu(&g.pci),
            );
            continue;
        };
        let figs = figures(g, report);
        // Its own checks, and the all-reduce it took part in (a finding of the whole run).
        let in_allreduce = report.allreduce.as_ref().is_some_and(|a| a.gpus.contains(&g.pci));
        let passed = findings
            .iter()
            .filter(|f| f.id.starts_with("probe."))
            .filter(|f| f.gpu.as_deref() == Some(g.pci.as_str()) || (f.id == "probe.allreduce" && in_allreduce))
            .all(|f| f.severity == Severity::Pass);
        let f = match base.gpus.get(&key).and_then(|l| l.get(&level)) {
            Some(b) => {
                let moved = drift(&b.figures, &figs);
                if moved.is_empty() {
                    Finding::pass(
                        ID,
                        format!(
                            "{} figure(s) within {:.0}% (latency {:.0}%) of this GPU's baseline of {}",
                            figs.keys().filter(|k| b.figures.contains_key(*k)).count(),
                            SLOWER * 100.0,
                            LATER * 100.0,
                            b.recorded_at
                        ),
                    )
                } else {
                    let text: Vec<String> = moved
                        .iter()
                        .map(|(n, was, is, c)| format!("{} {:+.1}% ({was:.1} → {is:.1})", label(n), c * 100.0))
                        .collect();
                    Finding::warn(ID, format!("since its baseline of {}: {}", b.recorded_at, text.join(", ")))
                        .detail("Still measured against the floors above, but this GPU has lost ground against its own earlier run: a link retrained narrower, a host or NUMA change, a GPU running hotter, memory wearing.")
                        .remedy("Probe again with nothing else running; if it stays, compare gpu.pcie-link, gpu.throttle and host placement with the baseline's run and report the GPU to the platform with both figures.")
                }
                .evidence("baseline", b)
            }
            // A run beside another process does not set the GPU's own mark (issue 51).
            None if passed && g.contended_by.is_empty() => {
                base.gpus.entry(key.clone()).or_default().insert(
                    level.clone(),
                    Baseline { pci: g.pci.clone(), recorded_at: now.clone(), figures: figs.clone() },
                );
                changed = true;
                Finding::pass(ID, format!("baseline recorded: this GPU's first {level} run that passed every probe"))
            }
            None => Finding::pass(
                ID,
                format!("no baseline yet: it is recorded from this GPU's first {level} run that passes every probe"),
            ),
        };
        out.push(f.gpu(&g.pci).evidence("serial", &key).evidence("figures", &figs));
    }
    if changed {
        let write = serde_json::to_vec_pretty(&base)
            .map_err(|e| e.to_string())
            .and_then(|b| crate::durable::write(&path, &b, 0o644).map_err(|e| e.to_string()));
        if let Err(e) = write {
            tracing::warn!(path = %path.display(), error = %e, "cannot record the probe baseline");
            for f in out.iter_mut() {
                if f.summary.starts_with("baseline recorded") {
                    *f = Finding::unknown(ID, format!("the baseline could not be written to {}: {e}", path.display()))
                        .gpu(f.gpu.clone().unwrap_or_default());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figs(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn slower_bandwidth_and_longer_latency_drift_and_small_changes_do_not() {
        let base = figs(&[("h2d_gbps", 52.0), ("host_latency_ns", 1000.0), ("gemm_tflops", 50.0)]);
        assert!(
            drift(&base, &figs(&[("h2d_gbps", 48.0), ("host_latency_ns", 1200.0), ("gemm_tflops", 55.0)])).is_empty()
        );
        let d = drift(&base, &figs(&[("h2d_gbps", 45.7), ("host_latency_ns", 1300.0), ("gemm_tflops", 50.0)]));
        let names: Vec<&str> = d.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(names, ["h2d_gbps", "host_latency_ns"]);
        assert!((d[0].3 + 0.1212).abs() < 1e-3, "{d:?}");
        // Faster is never drift.
        assert!(drift(&base, &figs(&[("h2d_gbps", 60.0), ("host_latency_ns", 500.0)])).is_empty());
    }

    #[test]
    fn a_run_without_cublas_is_its_own_figure_not_cublas_fallen() {
        assert_eq!(gemm_figure("gemm", "cuBLAS SGEMM"), "gemm_tflops");
        assert_eq!(gemm_figure("gemm_tensor", "PTX tensor cores, BF16 (phq_mma_gemm)"), "gemm_tensor_ptx_tflops");
        // The H200's two runs of 2026-12-04: cuBLAS first (the baseline), then the agent's kernels.
        let base = figs(&[("gemm_tflops", 50.9), ("gemm_tensor_tflops", 793.8), ("d2d_gbps", 3924.0)]);
        let own = figs(&[("gemm_ptx_tflops", 8.1), ("gemm_tensor_ptx_tflops", 19.6), ("d2d_gbps", 3899.4)]);
        assert!(drift(&base, &own).is_empty());
        assert_eq!(label("gemm_tensor_ptx_tflops"), "tensor-core GEMM by the agent's own kernel (TFLOP/s)");
    }

    #[test]
    fn a_fifo_or_garbage_is_an_error_naming_the_file_and_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE);
        assert_eq!(load(&p), Ok(Baselines::default()));
        std::fs::write(&p, b"{not json").unwrap();
        let e = load(&p).unwrap_err();
        assert!(e.contains(FILE) && e.contains("not a baseline file"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"{not json");
        std::fs::remove_file(&p).unwrap();
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(load(&p).unwrap_err().contains("not a regular file"));
    }
}
