//! Memory health, per GPU from NVML: gpu.ecc-mode, gpu.ecc-uncorrectable, gpu.sram-ecc (on-die
//! SRAM apart from the HBM), gpu.row-remap and gpu.inforom (the InfoROM keeps the ECC and retirement records). Thresholds come from `facts`.

use super::{missing, on_off, Finding};
use crate::facts;
use crate::snapshot::{EccCounts, EccLocation, Nv, NvmlGpu, Snapshot};

pub(super) fn ecc_mode(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.ecc-mode";
    match &g.ecc_mode {
        Nv::Value(m) if m.current && m.pending => Finding::pass(ID, "ECC on"),
        Nv::Value(m) if m.current != m.pending => Finding::warn(
            ID,
            format!("ECC {} now, {} after the next GPU reset", on_off(m.current), on_off(m.pending)),
        )
        .remedy(
            "Reset the GPU (restart the VM) to apply the pending ECC mode; data-center GPUs should run with ECC on.",
        ),
        Nv::Value(_) => Finding::warn(ID, "ECC is off")
            .detail("Without ECC, HBM bit flips silently corrupt results instead of being corrected or reported.")
            .remedy("`nvidia-smi -i <gpu> -e 1`, then reset the GPU (restart the VM)."),
        other => missing(ID, "ECC mode", other),
    }
    .evidence("ecc_mode", &g.ecc_mode)
}

pub(super) fn ecc_uncorrectable(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.ecc-uncorrectable";
    let (v, a) = match (&g.ecc_volatile, &g.ecc_aggregate) {
        (Nv::Value(v), Nv::Value(a)) => (*v, *a),
        (Nv::Value(v), _) => (*v, *v),
        (other, _) => return missing(ID, "ECC counters", other),
    };
    let f = if v.uncorrected > 0 {
        Finding::fail(ID, format!("{} uncorrectable ECC error(s) since the last GPU reset", v.uncorrected))
            .detail("Double-bit errors: data was lost, and the application that held it was stopped (Xid 48/94/95).")
            .remedy("Drain the GPU and reset it (restart the VM) so the affected rows are remapped; if uncorrectable errors come back, report the GPU to the platform.")
    } else if v.corrected > facts::MAX_CORRECTED_ECC {
        Finding::warn(ID, format!("{} corrected ECC errors since the last reset", v.corrected)).remedy(
            "A high single-bit error rate precedes failures: report the GPU to the platform and watch the count.",
        )
    } else if let (true, Some(rows)) = (a.uncorrected > 0, repaired(g)) {
        // Repaired: the row remapper took the failing rows out of use and nothing is pending. NVML's
        // reference (`nvmlDeviceGetRemappedRows`) counts such rows as active remappings, and
        // says even a pending one "won't affect future work on the GPU". Seen on an H200 of
        // docs/hardware-validation.md (1 lifetime DBE, 1 row remapped): a warning there routed
        // the platform to reset a repaired GPU.
        Finding::pass(
            ID,
            format!(
                "{} uncorrectable ECC error(s) over the GPU's life, none since the last reset; repaired by row remapping ({rows} row(s), none pending)",
                a.uncorrected
            ),
        )
    } else if a.uncorrected > 0 {
        Finding::warn(ID, format!("{} uncorrectable ECC error(s) over the GPU's life, none since the last reset", a.uncorrected))
            .remedy("Check gpu.row-remap: if the rows were remapped the GPU is fine; if the lifetime count keeps growing, report the GPU.")
    } else {
        Finding::pass(ID, "no uncorrectable ECC errors")
    };
    f.evidence("volatile", v).evidence("aggregate", a)
}

/// Rows remapped for uncorrectable errors, when the remapper reports them done: at least one,
/// none pending, no failure.
fn repaired(g: &NvmlGpu) -> Option<u32> {
    g.remapped_rows.value().filter(|r| r.uncorrectable > 0 && !r.pending && !r.failure).map(|r| r.uncorrectable)
}

/// gpu.sram-ecc: on-die SRAM and the HBM apart, with Azure's thresholds for ND H100/H200 v5
/// (`facts::MAX_SRAM_CORRECTED_ECC`, `facts::MAX_DRAM_ECC`). Row remapping heals the HBM, never
/// the SRAM: an uncorrectable SRAM error is the die's, and no reset takes it away.
pub(super) fn sram_ecc(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.sram-ecc";
    let sram = match &g.ecc_sram {
        Nv::Value(v) => *v,
        other => return missing(ID, "SRAM ECC counters", other),
    };
    let dram = g.ecc_dram.value().copied();
    let worst = |l: &EccLocation, f: fn(&EccCounts) -> u64| f(&l.volatile).max(f(&l.aggregate));
    let (sram_unc, sram_corr) = (worst(&sram, |c| c.uncorrected), worst(&sram, |c| c.corrected));
    let dram_worst = dram.map(|d| worst(&d, |c| c.corrected).max(worst(&d, |c| c.uncorrected)));
    let f = if sram_unc > 0 {
        Finding::fail(ID, format!("{sram_unc} uncorrectable SRAM ECC error(s) (on-die, not HBM)"))
            .detail("SRAM is on the GPU die (caches, register files); row remapping repairs HBM only, so nothing in the guest or a reset heals it. Azure's health checks fail a GPU with any (NHC2019).")
            .remedy("Report the GPU to the platform for replacement, by its serial.")
    } else if sram_corr > facts::MAX_SRAM_CORRECTED_ECC {
        Finding::fail(ID, format!("{sram_corr} corrected SRAM ECC errors, over {}", facts::MAX_SRAM_CORRECTED_ECC))
            .detail("So many single-bit SRAM errors precede uncorrectable ones on the die.")
            .remedy("Report the GPU to the platform for replacement, by its serial.")
    } else if let Some(n) = dram_worst.filter(|n| *n > facts::MAX_DRAM_ECC) {
        Finding::fail(ID, format!("{n} HBM (DRAM) ECC errors, over {}", facts::MAX_DRAM_ECC))
            .remedy("Report the GPU to the platform: its HBM is failing faster than row remapping can keep up.")
    } else {
        Finding::pass(ID, format!("SRAM: {sram_unc} uncorrectable, {sram_corr} corrected"))
    };
    f.evidence("sram", sram).evidence("dram", dram)
}

pub(super) fn row_remap(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.row-remap";
    let r = match &g.remapped_rows {
        Nv::Value(r) => *r,
        other => return missing(ID, "remapped rows", other),
    };
    let f = if r.failure {
        Finding::fail(ID, "row remapping failed: the GPU has no spare row left for a failing one")
            .remedy("Take the GPU out of service and report it to the platform for replacement (Xid 64).")
    } else if r.uncorrectable > facts::MAX_UNCORRECTABLE_REMAPPED_ROWS {
        Finding::fail(
            ID,
            format!(
                "{} rows remapped for uncorrectable errors (limit {})",
                r.uncorrectable,
                facts::MAX_UNCORRECTABLE_REMAPPED_ROWS
            ),
        )
        .remedy("Report the GPU to the platform for replacement.")
    } else if r.pending {
        Finding::warn(ID, "a row remap is pending: it takes effect at the next GPU reset")
            .detail("Until the reset, the failing row is still in use and can raise more uncorrectable errors.")
            .remedy("Drain the GPU and reset it (restart the VM); then check that pending is cleared.")
    } else {
        Finding::pass(
            ID,
            format!("{} correctable / {} uncorrectable rows remapped, none pending", r.correctable, r.uncorrectable),
        )
    };
    f.evidence("remapped_rows", r)
}

pub(super) fn inforom(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.inforom";
    match &g.inforom_valid {
        Nv::Value(true) => Finding::pass(ID, format!("InfoROM {} valid", g.inforom_image_version.value().map(String::as_str).unwrap_or(""))),
        Nv::Value(false) => Finding::warn(ID, "InfoROM is corrupted")
            .detail("The InfoROM holds ECC counts, retired pages and configuration; a corrupted one makes those unreliable.")
            .remedy("Report the GPU to the platform (it needs an InfoROM recovery or replacement)."),
        other => missing(ID, "InfoROM", other),
    }
    .evidence("image_version", &g.inforom_image_version)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::checks::Severity;
    use crate::facts;
    use crate::snapshot::*;

    #[test]
    fn dbe_with_pending_remap() {
        let mut s = healthy();
        let g = gpu_mut(&mut s, 2);
        g.ecc_volatile = Nv::Value(EccCounts { corrected: 3, uncorrected: 2 });
        g.remapped_rows = Nv::Value(RemappedRows { correctable: 0, uncorrectable: 1, pending: true, failure: false });
        let mut got = bad(&findings(&s));
        got.sort();
        assert_eq!(
            got,
            vec![
                ("gpu.ecc-uncorrectable".into(), "0000:0b:00.0".into(), Severity::Fail),
                ("gpu.row-remap".into(), "0000:0b:00.0".into(), Severity::Warn)
            ]
        );
    }

    #[test]
    fn ecc_mode_off_or_pending() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).ecc_mode = Nv::Value(CurrentPending { current: false, pending: false });
        assert_eq!(one(&s, "gpu.ecc-mode").summary, "ECC is off");
        gpu_mut(&mut s, 0).ecc_mode = Nv::Value(CurrentPending { current: true, pending: false });
        let f = one(&s, "gpu.ecc-mode");
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.summary, "ECC on now, off after the next GPU reset");
    }

    #[test]
    fn ecc_lifetime_and_corrected_counts_warn() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).ecc_aggregate = Nv::Value(EccCounts { corrected: 5, uncorrected: 3 });
        assert_eq!(one(&s, "gpu.ecc-uncorrectable").severity, Severity::Warn);
        // The H200 of 2026-12-04: its lifetime DBE's row remapped, nothing pending: repaired.
        let done = RemappedRows { correctable: 0, uncorrectable: 1, pending: false, failure: false };
        gpu_mut(&mut s, 0).remapped_rows = Nv::Value(done);
        let f = one(&s, "gpu.ecc-uncorrectable");
        assert_eq!(f.severity, Severity::Pass, "{}", f.summary);
        assert!(f.summary.contains("repaired by row remapping (1 row(s), none pending)"), "{}", f.summary);
        // Pending or failed, it is not repaired yet.
        gpu_mut(&mut s, 0).remapped_rows = Nv::Value(RemappedRows { pending: true, ..done });
        assert_eq!(one(&s, "gpu.ecc-uncorrectable").severity, Severity::Warn);
        gpu_mut(&mut s, 0).remapped_rows = Nv::Value(RemappedRows { failure: true, ..done });
        assert_eq!(one(&s, "gpu.ecc-uncorrectable").severity, Severity::Warn);
        gpu_mut(&mut s, 0).remapped_rows = Nv::Value(done);
        gpu_mut(&mut s, 0).ecc_volatile =
            Nv::Value(EccCounts { corrected: facts::MAX_CORRECTED_ECC + 1, uncorrected: 0 });
        assert!(one(&s, "gpu.ecc-uncorrectable").summary.contains("corrected ECC errors"));
    }

    #[test]
    fn row_remap_failure_and_limit_fail() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).remapped_rows =
            Nv::Value(RemappedRows { correctable: 0, uncorrectable: 3, pending: false, failure: true });
        assert_eq!(one(&s, "gpu.row-remap").severity, Severity::Fail);
        gpu_mut(&mut s, 0).remapped_rows =
            Nv::Value(RemappedRows { correctable: 0, uncorrectable: 513, pending: false, failure: false });
        assert!(one(&s, "gpu.row-remap").summary.contains("limit 512"));
    }
}
