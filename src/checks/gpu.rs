//! The GPU as a device: gpu.sku-known (its PCI id), gpu.firmware-consistent (one VBIOS and
//! InfoROM image per model across the VM), and per GPU from NVML driver.persistence,
//! gpu.pcie-link and gpu.pcie-replay (its host link) and gpu.mig-pending.

use super::{gpu_model, missing, on_off, Finding};
use crate::facts;
use crate::snapshot::{Nv, NvmlGpu, NvmlInfo, Snapshot};
use std::collections::BTreeMap;

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    sku_known(s, out);
}

fn sku_known(s: &Snapshot, out: &mut Vec<Finding>) {
    const ID: &str = "gpu.sku-known";
    let gpus = s.gpus();
    if gpus.is_empty() {
        out.push(Finding::pass(ID, "no NVIDIA GPU: nothing to check"));
    }
    for g in gpus {
        let id = format!("10de:{:04x}", g.device.unwrap_or(0));
        let f = match g.device.and_then(facts::sku) {
            Some(sku) => Finding::pass(ID, format!("{} ({id})", sku.name)),
            None => Finding::warn(ID, format!("{} ({id}) is not a GPU this agent has floors for", gpu_model(g)))
                .detail("The checks still run, but thresholds and probe floors are made for Hopper (H100, H200) and may not fit.")
                .remedy("Nothing to fix on the GPU; report the device id so it can be added to the SKU table."),
        };
        out.push(f.gpu(&g.address).evidence("pci_id", id).evidence(
            "subsystem",
            g.subsystem_device.map(|d| format!("{:04x}:{d:04x}", g.subsystem_vendor.unwrap_or(0))),
        ));
    }
}

/// gpu.firmware-consistent: the VM's GPUs of one model run one VBIOS and one InfoROM image.
/// Azure's health checks fail a node whose GPUs report more than one VBIOS version
/// (azurehpc-health-checks, `customTests/azure_gpu_vbios.nhc`, fault code NHC2001): on one
/// baseboard that is the trace of a part swapped without the firmware the others run. Models
/// are compared apart (an H100 PCIe beside an H200 may differ by design). A GPU whose versions
/// NVML did not read is left out and named.
pub(super) fn firmware_consistent(n: &NvmlInfo) -> Finding {
    const ID: &str = "gpu.firmware-consistent";
    // model → firmware kind → version → the GPUs that run it.
    let mut seen: BTreeMap<String, [BTreeMap<String, Vec<String>>; 2]> = BTreeMap::new();
    let mut unread = vec![];
    for g in &n.devices {
        let (Nv::Value(vbios), Nv::Value(inforom)) = (&g.vbios_version, &g.inforom_image_version) else {
            unread.push(super::gpu_label(g));
            continue;
        };
        let model = g.name.value().cloned().unwrap_or_else(|| "unknown model".into());
        let kinds = seen.entry(model).or_default();
        kinds[0].entry(vbios.clone()).or_default().push(super::gpu_label(g));
        kinds[1].entry(inforom.clone()).or_default().push(super::gpu_label(g));
    }
    let compared: usize = seen.values().map(|k| k[0].values().map(Vec::len).sum::<usize>()).sum();
    let mut differ = vec![];
    for (model, kinds) in &seen {
        for (kind, versions) in ["VBIOS", "InfoROM image"].iter().zip(kinds) {
            if versions.len() > 1 {
                let each: Vec<String> =
                    versions.iter().map(|(v, gpus)| format!("{v} on {}", gpus.join(", "))).collect();
                differ.push(format!("{model}: {} {kind} versions: {}", versions.len(), each.join("; ")));
            }
        }
    }
    let f = if !differ.is_empty() {
        Finding::warn(ID, differ.join(" | "))
            .detail("GPUs of one model on one baseboard ship with one firmware; a GPU that differs was most likely swapped in without it, and firmware differences change behaviour (NVLink training, power and clock policy) between GPUs that a job expects to be alike.")
            .remedy("Report the node to the platform: bring every GPU of the baseboard to one VBIOS (NVIDIA's firmware update for the board), and check the swapped part by its serial.")
    } else if compared < 2 {
        Finding::pass(ID, format!("{compared} GPU with readable firmware versions: nothing to compare"))
    } else {
        let one: Vec<String> =
            seen.iter().map(|(m, k)| format!("{m}: VBIOS {}", k[0].keys().next().map_or("", String::as_str))).collect();
        Finding::pass(ID, format!("{compared} GPUs agree ({})", one.join(", ")))
    };
    let f = if unread.is_empty() { f } else { f.evidence("unread", unread) };
    f.evidence("gpus_compared", compared)
}

pub(super) fn persistence(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "driver.persistence";
    let unit = s.unit(PERSISTENCED);
    let f = match (&g.persistence_mode, unit) {
        (Nv::Value(true), Some(u)) if u.active_state != "active" => {
            Finding::pass(ID, "persistence mode on").detail(format!("nvidia-persistenced is {}: the mode was set another way (`nvidia-smi -pm 1`), which does not survive a reboot.", u.active_state))
        }
        (Nv::Value(true), _) => Finding::pass(ID, "persistence mode on"),
        (Nv::Value(false), u) => Finding::warn(ID, "persistence mode off")
            .detail("Without persistence the driver tears the GPU down whenever no client holds it: every CUDA start pays seconds of initialisation, and state such as ECC counters and clocks is reloaded.")
            .remedy(match u {
                Some(u) if !u.exists() => "Install nvidia-persistenced (it ships with the driver's utilities) and `systemctl enable --now nvidia-persistenced`.",
                Some(u) if u.active_state == "failed" => "nvidia-persistenced failed: read `journalctl -u nvidia-persistenced -b`, then `systemctl restart nvidia-persistenced`.",
                _ => "`systemctl enable --now nvidia-persistenced` (the daemon NVIDIA recommends over `nvidia-smi -pm 1`).",
            }),
        (other, _) => return missing(ID, "persistence mode", other),
    };
    f.evidence("unit", unit)
}

const PERSISTENCED: &str = "nvidia-persistenced.service";

pub(super) fn pcie_link(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.pcie-link";
    let p = &g.pcie;
    let (wc, wm) = match (&p.width_current, &p.width_max) {
        (Nv::Value(c), Nv::Value(m)) => (*c, *m),
        (Nv::Value(_), other) | (other, _) => return missing(ID, "PCIe link width", other),
    };
    let (gc, gm) = (p.gen_current.value().copied(), p.gen_max.value().copied());
    let busy = g.utilization.value().is_some_and(|u| u.gpu > 0);
    let gen_low = matches!((gc, gm), (Some(c), Some(m)) if c < m);
    let shown = format!(
        "Gen{} x{wc} of Gen{} x{wm}",
        gc.map_or("?".into(), |v| v.to_string()),
        gm.map_or("?".into(), |v| v.to_string())
    );
    let remedy = "Report the GPU to the platform: the link trained narrower or slower than the slot (card, riser or retimer). Confirm with `phq-agent probe` (probe.h2d-bandwidth).";
    let f = if wc * 2 <= wm {
        Finding::fail(ID, format!("{shown}: link width at half or less"))
            .detail("Host↔device bandwidth falls in proportion to the width.")
            .remedy(remedy)
    } else if wc < wm {
        Finding::warn(ID, format!("{shown}: narrower link than the GPU supports")).remedy(remedy)
    } else if gen_low && busy {
        Finding::warn(ID, format!("{shown}: slower link generation while the GPU is busy")).remedy(remedy)
    } else if gen_low {
        Finding::pass(ID, format!("{shown} (idle GPUs lower their link generation)"))
    } else {
        Finding::pass(ID, shown)
    };
    f.evidence("pcie", p)
}

pub(super) fn pcie_replay(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.pcie-replay";
    let n = match &g.pcie.replay_counter {
        Nv::Value(n) => *n,
        other => return missing(ID, "PCIe replay counter", other),
    };
    let Some(uptime) = s.host.uptime_s.filter(|u| *u > 0.0) else {
        return Finding::pass(ID, format!("{n} PCIe replays (uptime unknown, so no rate)")).evidence("replays", n);
    };
    let per_minute = n as f64 / (uptime / 60.0).max(1.0);
    let f = if per_minute > facts::PCIE_REPLAYS_PER_MINUTE {
        Finding::warn(
            ID,
            format!(
                "{n} PCIe replays since boot, {per_minute:.0} per minute (budget {})",
                facts::PCIE_REPLAYS_PER_MINUTE
            ),
        )
        .detail("Replays retransmit corrupted PCIe packets: a marginal link costs bandwidth and can end in Xid 79.")
        .remedy("Report the GPU to the platform (link, riser or retimer); confirm with `phq-agent probe`.")
    } else {
        Finding::pass(ID, format!("{n} PCIe replays since boot"))
    };
    f.evidence("replays", n).evidence("per_minute", (per_minute * 100.0).round() / 100.0)
}

pub(super) fn mig_pending(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.mig-pending";
    match &g.mig_mode {
        Nv::Value(m) if m.current != m.pending => Finding::warn(ID, format!("MIG {} now, {} after the next GPU reset", on_off(m.current), on_off(m.pending)))
            .remedy("Reset the GPU (restart the VM) to apply the pending MIG mode, or set it back (`nvidia-smi -i <gpu> -mig 0|1`)."),
        Nv::Value(m) => Finding::pass(ID, format!("MIG {}, nothing pending", on_off(m.current))),
        other => missing(ID, "MIG mode", other),
    }
    .evidence("mig", &g.mig_mode)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    #[test]
    fn persistence_off_with_missing_daemon() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).persistence_mode = Nv::Value(false);
        if let Fact::Value(units) = &mut s.units {
            units[0].load_state = "not-found".into();
            units[0].active_state = "inactive".into();
        }
        let f = findings(&s);
        let p = find(&f, "driver.persistence")[0];
        assert_eq!(p.severity, Severity::Warn);
        assert!(p.remedy.as_ref().unwrap().starts_with("Install nvidia-persistenced"));
    }

    #[test]
    fn replay_rate_against_the_dcgm_budget() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).pcie.replay_counter = Nv::Value(100);
        assert_eq!(find(&findings(&s), "gpu.pcie-replay")[0].severity, Severity::Pass);
        gpu_mut(&mut s, 0).pcie.replay_counter = Nv::Value(60 * 40);
        assert_eq!(find(&findings(&s), "gpu.pcie-replay")[0].severity, Severity::Warn);
    }

    #[test]
    fn idle_gen_drop_passes_busy_gen_drop_warns() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).pcie.gen_current = Nv::Value(1);
        assert_eq!(one(&s, "gpu.pcie-link").severity, Severity::Pass);
        gpu_mut(&mut s, 0).utilization = Nv::Value(Utilization { gpu: 90, memory: 10 });
        assert_eq!(one(&s, "gpu.pcie-link").severity, Severity::Warn);
    }

    #[test]
    fn mig_pending_and_inforom() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).mig_mode = Nv::Value(CurrentPending { current: false, pending: true });
        assert_eq!(one(&s, "gpu.mig-pending").severity, Severity::Warn);
        gpu_mut(&mut s, 0).inforom_valid = Nv::Value(false);
        assert_eq!(one(&s, "gpu.inforom").severity, Severity::Warn);
    }
}
