//! nvml.init, and the per-GPU checks of what NVML reports, run GPU by GPU. The checks themselves
//! live in the room of what they judge: `fabric` (fabric manager, fabric state), `nvlink`,
//! `memory` (ECC, row remapping, InfoROM), `thermal` (throttling, temperature, power) and `gpu`
//! (persistence, PCIe link, MIG). Thresholds come from `facts`.
//!
//! Per-GPU rule: a reading NVML does not support (common in VMs) or could not read is
//! `unknown` with that reason — never a pass made of a zero.

use super::{fabric, gpu, gpu_label, memory, nvlink, thermal, Finding};
use crate::snapshot::{Nv, NvmlFailureKind, NvmlGpu, NvmlStatus, Snapshot};

type PerGpu = fn(&Snapshot, &NvmlGpu) -> Finding;

const PER_GPU: &[(&str, PerGpu)] = &[
    ("driver.persistence", gpu::persistence),
    ("fabric.state", fabric::fabric_state),
    ("nvlink.links-active", nvlink::links_active),
    ("nvlink.errors", nvlink::nvlink_errors),
    ("gpu.ecc-mode", memory::ecc_mode),
    ("gpu.ecc-uncorrectable", memory::ecc_uncorrectable),
    ("gpu.sram-ecc", memory::sram_ecc),
    ("gpu.row-remap", memory::row_remap),
    ("gpu.throttle", thermal::throttle),
    ("gpu.throttle-time", thermal::throttle_time),
    ("gpu.temperature", thermal::temperature),
    ("gpu.power-limit", thermal::power_limit),
    ("gpu.pcie-link", gpu::pcie_link),
    ("gpu.pcie-replay", gpu::pcie_replay),
    ("gpu.mig-pending", gpu::mig_pending),
    ("gpu.inforom", memory::inforom),
];

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    out.push(init(s));
    out.extend(responsive(s));
    let no_gpu = s.gpus().is_empty();
    let Some(nvml) = s.nvml() else {
        let why = match &s.nvml {
            NvmlStatus::NotRead(why) => why.clone(),
            NvmlStatus::Failed(f) => format!("NVML failed to initialise: {}", f.message),
            NvmlStatus::Ok(_) => String::new(),
        };
        let ids = ["fabric.manager-running", "fabric.manager-version", "gpu.firmware-consistent"]
            .into_iter()
            .chain(PER_GPU.iter().map(|(id, _)| *id));
        for id in ids {
            out.push(if no_gpu {
                Finding::pass(id, "no NVIDIA GPU: nothing to check")
            } else {
                Finding::unknown(id, why.clone())
            });
        }
        return;
    };
    out.push(fabric::manager_running(s));
    out.push(fabric::manager_version(s));
    if nvml.devices.is_empty() {
        for (id, _) in PER_GPU {
            out.push(Finding::pass(id, "NVML lists no GPU: nothing to check"));
        }
    }
    out.push(gpu::firmware_consistent(nvml));
    for g in &nvml.devices {
        let label = gpu_label(g);
        for (_, check) in PER_GPU {
            let mut f = check(s, g);
            f.gpu = Some(label.clone());
            if let Nv::Value(uuid) = &g.uuid {
                f.evidence.insert("uuid".into(), serde_json::Value::String(uuid.clone()));
            }
            out.push(f);
        }
    }
}

fn init(s: &Snapshot) -> Finding {
    const ID: &str = "nvml.init";
    let gpus = s.gpus();
    let failure = match &s.nvml {
        NvmlStatus::NotRead(why) => {
            return if gpus.is_empty() {
                Finding::pass(ID, "no NVIDIA GPU: nothing to check")
            } else {
                Finding::unknown(ID, why.clone())
            }
        }
        NvmlStatus::Failed(f) => f,
        NvmlStatus::Ok(n) => {
            let bound = gpus.iter().filter(|g| g.driver.as_deref() == Some("nvidia")).count();
            let version = n.driver_version.value().cloned().unwrap_or_else(|| "version unknown".into());
            let f = if n.devices.len() < bound {
                Finding::fail(ID, format!("NVML sees {} of the {bound} GPUs bound to nvidia", n.devices.len()))
                    .detail("A GPU the driver holds is not usable: it failed to initialise (see gpu.xid and `dmesg | grep NVRM`).")
                    .remedy("Restart the VM; if the GPU stays missing, report it to the platform with `phq-agent doctor --bundle`.")
            } else {
                Finding::pass(
                    ID,
                    format!(
                        "NVML {} on driver {version}, {} GPU(s)",
                        n.nvml_version.value().map(String::as_str).unwrap_or("?"),
                        n.devices.len()
                    ),
                )
            };
            return f
                .evidence("library", &n.library)
                .evidence("driver_version", &n.driver_version)
                .evidence("cuda_driver_version", &n.cuda_driver_version);
        }
    };
    let f = match failure.kind {
        NvmlFailureKind::LibraryNotFound if gpus.is_empty() => return Finding::pass(ID, "no NVML library and no NVIDIA GPU: nothing to check"),
        NvmlFailureKind::LibraryNotFound => Finding::fail(ID, "the NVML library is not installed")
            .detail(format!("{}. The driver's user-space part (libnvidia-ml, libcuda) is missing.", failure.message))
            .remedy("Run `phq-agent install`, or install the driver's utilities package (`nvidia-utils-<branch>-server` / `libnvidia-compute-<branch>`); with a library in an unusual place, pass `--nvml-lib PATH`."),
        NvmlFailureKind::DriverNotLoaded => Finding::fail(ID, "NVML: the NVIDIA kernel driver is not loaded")
            .detail(failure.message.clone())
            .remedy("`modprobe nvidia` and read `dmesg | grep -i nvidia` for why it did not load (see driver.module-loaded); `phq-agent install` repairs a broken install."),
        NvmlFailureKind::VersionMismatch => Finding::fail(ID, "NVML: driver/library version mismatch")
            .detail(format!("{}. The loaded kernel module and the installed libraries come from different driver versions: an upgrade without a reboot.", failure.message))
            .remedy("Reboot the VM (or, with no GPU process running, reload the module: `rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`); then hold the driver version."),
        NvmlFailureKind::NoPermission => Finding::fail(ID, "NVML: no permission to talk to the driver")
            .detail(failure.message.clone())
            .remedy("Run as root, or check the modes of /dev/nvidiactl and /dev/nvidia* (0666 by default; `NVreg_DeviceFileMode`)."),
        // Not a failure yet: it has not answered at all. nvml.responsive says so and fails.
        NvmlFailureKind::NotAnswering => Finding::unknown(ID, "NVML has not answered within its deadline")
            .detail(format!("{} (see nvml.responsive).", failure.message)),
        NvmlFailureKind::Other => Finding::fail(ID, "NVML failed to initialise").detail(failure.message.clone()).remedy("Read `dmesg | grep NVRM` for the driver's reason; restart the VM if the driver reports the GPU lost."),
    };
    f.evidence("library", &failure.library).evidence("kind", failure.kind)
}

/// nvml.responsive: every NVML call the snapshot made returned within its deadline. One
/// failing finding per call still blocked, naming the call, the GPU and how long; a GPU that
/// has fallen off the bus or a GSP that stopped answering (Xid 79, 119) shows here first.
fn responsive(s: &Snapshot) -> Vec<Finding> {
    const ID: &str = "nvml.responsive";
    if s.nvml_blocked.is_empty() {
        return vec![match &s.nvml {
            NvmlStatus::NotRead(_) => Finding::pass(ID, "NVML not asked: nothing to wait for"),
            _ => Finding::pass(ID, "NVML answered every call within its deadline"),
        }];
    }
    s.nvml_blocked
        .iter()
        .map(|b| {
            let mut f = Finding::fail(ID, format!("NVML is not answering: {}", b.describe()))
                .detail(format!(
                    "The call was made at {} and passed its {} s deadline; it cannot be cancelled, so it is \
                     not made again until it returns, and every reading NVML would have given through it is \
                     left out rather than shown stale. Everything read without NVML is still reported.",
                    b.since,
                    crate::snapshot::whole_seconds(b.deadline_ms)
                ))
                .remedy(
                    "Read `dmesg | grep -E 'NVRM|Xid'`: Xid 79 (GPU fallen off the bus) or 119/120 (GSP not \
                     answering) mean the GPU needs a reset or the VM a restart; report it to the platform \
                     with `phq-agent doctor --bundle`.",
                )
                .evidence("call", &b.call)
                .evidence("blocked_ms", b.blocked_ms)
                .evidence("deadline_ms", b.deadline_ms)
                .evidence("since", b.since.to_string());
            f.gpu = b.gpu.clone();
            f
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    #[test]
    fn healthy_has_no_alarm() {
        assert_eq!(bad(&findings(&healthy())), vec![]);
        assert!(findings(&healthy()).iter().all(|f| f.severity == Severity::Pass), "{:#?}", findings(&healthy()));
    }

    #[test]
    fn not_supported_is_unknown_never_fail() {
        let mut s = healthy();
        let g = gpu_mut(&mut s, 0);
        g.ecc_mode = Nv::NotSupported;
        g.ecc_volatile = Nv::NotSupported;
        g.remapped_rows = Nv::NotSupported;
        g.temperature_c = Nv::NotSupported;
        g.pcie.width_current = Nv::NotSupported;
        g.persistence_mode = Nv::NotSupported;
        let f = findings(&s);
        assert_eq!(bad(&f), vec![]);
        let unknown: Vec<&str> = f.iter().filter(|f| f.severity == Severity::Unknown).map(|f| f.id.as_str()).collect();
        assert_eq!(unknown.len(), 6, "{unknown:?}");
        assert!(f.iter().filter(|f| f.severity == Severity::Unknown).all(|f| f.summary.contains("not supported")));
    }

    #[test]
    fn init_failures_are_told_apart() {
        for (kind, words) in [
            (NvmlFailureKind::DriverNotLoaded, "not loaded"),
            (NvmlFailureKind::VersionMismatch, "mismatch"),
            (NvmlFailureKind::NoPermission, "permission"),
            (NvmlFailureKind::LibraryNotFound, "not installed"),
        ] {
            let mut s = healthy();
            s.nvml = NvmlStatus::Failed(NvmlFailure { kind, library: "libnvidia-ml.so.1".into(), message: "x".into() });
            let f = findings(&s);
            let i = find(&f, "nvml.init")[0];
            assert_eq!(i.severity, Severity::Fail);
            assert!(i.summary.contains(words), "{kind:?}: {}", i.summary);
            // NVML answered (with a failure), so nvml.responsive passes; the rest cannot be known.
            assert_eq!(find(&f, "nvml.responsive")[0].severity, Severity::Pass);
            let rest = f.iter().filter(|f| f.id != "nvml.init" && f.id != "nvml.responsive");
            assert!(rest.into_iter().all(|f| f.severity == Severity::Unknown));
        }
    }

    #[test]
    fn a_blocked_call_fails_nvml_responsive_naming_the_call_the_gpu_and_how_long() {
        let mut s = healthy();
        assert_eq!(find(&findings(&s), "nvml.responsive")[0].severity, Severity::Pass);
        s.nvml_blocked.push(BlockedCall {
            call: "nvmlDeviceGetMemoryInfo_v2".into(),
            gpu: Some("0000:0b:00.0".into()),
            since: Timestamp::from_unix_millis(1_764_000_000_000),
            blocked_ms: 42_400,
            deadline_ms: 5_000,
        });
        let f = findings(&s);
        let r = find(&f, "nvml.responsive");
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].severity, Severity::Fail);
        assert_eq!(r[0].gpu.as_deref(), Some("0000:0b:00.0"));
        assert_eq!(
            r[0].summary,
            "NVML is not answering: nvmlDeviceGetMemoryInfo_v2 (GPU 0000:0b:00.0) has not returned for 42 s"
        );
    }

    #[test]
    fn an_init_that_has_not_answered_is_unknown_to_nvml_init_and_a_failure_of_nvml_responsive() {
        let mut s = healthy();
        s.nvml = NvmlStatus::Failed(NvmlFailure {
            kind: NvmlFailureKind::NotAnswering,
            library: "libnvidia-ml.so.1".into(),
            message: "nvmlInit_v2 has not returned for 3 s (deadline 3 s)".into(),
        });
        s.nvml_blocked.push(BlockedCall {
            call: "nvmlInit_v2".into(),
            gpu: None,
            since: Timestamp::from_unix_millis(1_764_000_000_000),
            blocked_ms: 3_000,
            deadline_ms: 3_000,
        });
        let f = findings(&s);
        assert_eq!(find(&f, "nvml.init")[0].severity, Severity::Unknown);
        let r = find(&f, "nvml.responsive");
        assert_eq!((r[0].severity, r[0].gpu.as_deref()), (Severity::Fail, None));
        assert!(r[0].summary.contains("nvmlInit_v2 has not returned for 3 s"), "{}", r[0].summary);
    }

    #[test]
    fn nvml_missing_a_gpu_the_driver_holds_fails() {
        let mut s = healthy();
        if let NvmlStatus::Ok(n) = &mut s.nvml {
            n.devices.pop();
        }
        let f = findings(&s);
        assert_eq!(find(&f, "nvml.init")[0].summary, "NVML sees 7 of the 8 GPUs bound to nvidia");
    }
}
