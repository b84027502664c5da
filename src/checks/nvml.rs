//! Checks that judge what NVML reports: nvml.init, driver.persistence, fabric.*, nvlink.* and
//! the per-GPU gpu.* health signals. Thresholds come from `facts`.
//!
//! Per-GPU rule: a reading NVML does not support (common in VMs) or could not read is
//! `unknown` with that reason — never a pass made of a zero.

use super::Finding;
use crate::facts::{self, ThrottleClass};
use crate::snapshot::{FabricState, Nv, NvmlFailureKind, NvmlGpu, NvmlStatus, Snapshot};

type PerGpu = fn(&Snapshot, &NvmlGpu) -> Finding;

const PER_GPU: &[(&str, PerGpu)] = &[
    ("driver.persistence", persistence),
    ("fabric.state", fabric_state),
    ("nvlink.links-active", links_active),
    ("nvlink.errors", nvlink_errors),
    ("gpu.ecc-mode", ecc_mode),
    ("gpu.ecc-uncorrectable", ecc_uncorrectable),
    ("gpu.row-remap", row_remap),
    ("gpu.throttle", throttle),
    ("gpu.temperature", temperature),
    ("gpu.power-limit", power_limit),
    ("gpu.pcie-link", pcie_link),
    ("gpu.pcie-replay", pcie_replay),
    ("gpu.mig-pending", mig_pending),
    ("gpu.inforom", inforom),
];

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    out.push(init(s));
    let no_gpu = s.gpus().is_empty();
    let Some(nvml) = s.nvml() else {
        let why = match &s.nvml {
            NvmlStatus::NotRead(why) => why.clone(),
            NvmlStatus::Failed(f) => format!("NVML failed to initialise: {}", f.message),
            NvmlStatus::Ok(_) => String::new(),
        };
        let ids =
            ["fabric.manager-running", "fabric.manager-version"].into_iter().chain(PER_GPU.iter().map(|(id, _)| *id));
        for id in ids {
            out.push(if no_gpu {
                Finding::pass(id, "no NVIDIA GPU: nothing to check")
            } else {
                Finding::unknown(id, why.clone())
            });
        }
        return;
    };
    out.push(manager_running(s));
    out.push(manager_version(s));
    if nvml.devices.is_empty() {
        for (id, _) in PER_GPU {
            out.push(Finding::pass(id, "NVML lists no GPU: nothing to check"));
        }
    }
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

/// The PCI address NVML gives, or its index when it gave none.
pub fn gpu_label(g: &NvmlGpu) -> String {
    g.pci_address.value().cloned().unwrap_or_else(|| format!("nvml:{}", g.index))
}

/// A reading that is not there: unknown, with NVML's reason.
fn missing<T>(id: &str, what: &str, v: &Nv<T>) -> Finding {
    Finding::unknown(id, format!("{what}: {}", v.why_not()))
}

fn has_nvswitches(s: &Snapshot) -> bool {
    !s.nvswitches().is_empty()
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
        NvmlFailureKind::Other => Finding::fail(ID, "NVML failed to initialise").detail(failure.message.clone()).remedy("Read `dmesg | grep NVRM` for the driver's reason; restart the VM if the driver reports the GPU lost."),
    };
    f.evidence("library", &failure.library).evidence("kind", failure.kind)
}

fn persistence(s: &Snapshot, g: &NvmlGpu) -> Finding {
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

const FABRIC_MANAGER: &str = "nvidia-fabricmanager.service";
const PERSISTENCED: &str = "nvidia-persistenced.service";

fn manager_running(s: &Snapshot) -> Finding {
    const ID: &str = "fabric.manager-running";
    let unit = s.unit(FABRIC_MANAGER);
    if !has_nvswitches(s) {
        // Enabled without NVSwitches, it exits with NV_WARN_NOTHING_TO_DO and leaves a failed unit.
        return match unit.filter(|u| u.exists() && (u.active_state == "failed" || u.unit_file_state == "enabled")) {
            Some(u) => Finding::warn(ID, format!("nvidia-fabricmanager is {} in a VM without NVSwitches", if u.active_state == "failed" { "failed" } else { "enabled" }))
                .detail("Without NVSwitches in the guest the fabric manager has nothing to manage and exits with NV_WARN_NOTHING_TO_DO, leaving a failed unit (and a degraded system) behind.")
                .remedy("`systemctl disable --now nvidia-fabricmanager && systemctl reset-failed nvidia-fabricmanager`.")
                .evidence("unit", u),
            None => Finding::pass(ID, "no NVSwitch in this VM: the fabric manager is not needed here"),
        };
    }
    let states: Vec<(String, &Nv<crate::snapshot::FabricInfo>)> =
        s.nvml().map(|n| n.devices.iter().map(|g| (gpu_label(g), &g.fabric)).collect()).unwrap_or_default();
    let not_started: Vec<&str> = states
        .iter()
        .filter(|(_, f)| f.value().is_some_and(|f| f.state == FabricState::NotStarted))
        .map(|(l, _)| l.as_str())
        .collect();
    let completed = states.iter().filter(|(_, f)| f.value().is_some_and(|f| f.state == FabricState::Completed)).count();
    // A GPU whose fabric state cannot be read (one that fell off the bus) says nothing about
    // the fabric manager; the others do.
    let readable = states.iter().filter(|(_, f)| f.value().is_some()).count();
    let error_802 = "Until the fabric manager trains NVLink through the NVSwitches, every CUDA program fails with error 802 (cudaErrorSystemNotReady, \"system not yet initialized\").";
    let f = match unit {
        Some(u) if !u.exists() => Finding::fail(ID, "nvidia-fabricmanager is not installed")
            .detail(format!("This VM sees NVSwitches. {error_802}"))
            .remedy("Install nvidia-fabricmanager at exactly the driver's version (`phq-agent install` does it), then `systemctl enable --now nvidia-fabricmanager`."),
        Some(u) if u.active_state != "active" => Finding::fail(ID, format!("nvidia-fabricmanager is {} ({})", u.active_state, u.sub_state))
            .detail(format!("{error_802} {} GPU(s) report fabric state not_started.", not_started.len()))
            .remedy(if u.active_state == "failed" {
                "Read why: `journalctl -u nvidia-fabricmanager -b` (a version different from the driver's is the usual cause; see fabric.manager-version), fix it, then `systemctl restart nvidia-fabricmanager`."
            } else {
                "`systemctl enable --now nvidia-fabricmanager`."
            }),
        _ if !not_started.is_empty() => Finding::fail(ID, "nvidia-fabricmanager is not running: the NVSwitch fabric was never set up")
            .detail(format!("{} GPU(s) report fabric state not_started. {error_802}", not_started.len()))
            .remedy("Install nvidia-fabricmanager at exactly the driver's version (`nvidia-fabricmanager-<branch>`; `phq-agent install` does it) and `systemctl enable --now nvidia-fabricmanager`; check `journalctl -u nvidia-fabricmanager` for errors."),
        Some(_) => Finding::pass(ID, format!("nvidia-fabricmanager is active; fabric trained on {completed} GPU(s)")),
        // Without systemd's word the unit's state is unknown, even when a trained fabric says
        // the fabric manager did run at some point.
        None if completed == readable && completed > 0 => Finding::unknown(ID, format!("cannot ask systemd about nvidia-fabricmanager: {}", s.units.error().unwrap_or("unit unknown")))
            .detail(format!("The fabric is trained on {completed} GPU(s), so it ran at some point.")),
        None => Finding::unknown(ID, format!("neither systemd ({}) nor the GPUs' fabric state tell whether the fabric manager runs", s.units.error().unwrap_or("unit unknown"))),
    };
    f.evidence("nvswitches", s.nvswitches().len()).evidence("not_started", not_started).evidence("unit", unit)
}

fn manager_version(s: &Snapshot) -> Finding {
    const ID: &str = "fabric.manager-version";
    if !has_nvswitches(s) {
        return Finding::pass(ID, "no NVSwitch in this VM: no fabric manager to match");
    }
    let driver = s
        .nvml()
        .and_then(|n| n.driver_version.value().cloned())
        .or_else(|| s.driver.nvrm.value().map(|v| v.version.clone()));
    let Some(driver) = driver else { return Finding::unknown(ID, "the driver version is unknown") };
    // NVML's fabric state is evidence of its own: on an NVSwitch system the fabric completes
    // only through a fabric manager, and the fabric manager does not start against a driver of
    // another version (NVIDIA Fabric Manager User Guide). So a completed fabric says a matching
    // fabric manager runs, whatever the package database says or cannot say.
    let completed = s.nvml().is_some_and(|n| {
        !n.devices.is_empty()
            && n.devices.iter().all(|g| matches!(&g.fabric, Nv::Value(f) if f.state == FabricState::Completed))
    });
    let packages = match &s.packages {
        Fact::Value(p) => p,
        Fact::Error(e) if completed => {
            return Finding::pass(ID, "fabric completed on every GPU: the fabric manager that runs matches the driver")
                .detail(format!("The fabric manager does not start against a driver of another version, so a completed fabric is a match. Its package cannot be named: {e}."))
                .evidence("driver", driver)
        }
        Fact::Error(e) => {
            return Finding::unknown(ID, format!("cannot tell whether a fabric manager is installed: {e}"))
                .detail("NVML does not report the fabric completed either, so nothing here shows a fabric manager of the driver's version.")
                .evidence("driver", driver)
        }
    };
    let fm: Vec<&crate::snapshot::Package> = packages
        .iter()
        .filter(|p| p.name.starts_with("nvidia-fabricmanager") || p.name == "nvidia-fabric-manager")
        .collect();
    let branch = facts::driver_branch(&driver).unwrap_or(0);
    // The package's name on Debian/Ubuntu: branch-suffixed below 580, plain from 580 on.
    let name =
        if branch >= 580 { "nvidia-fabricmanager".to_string() } else { format!("nvidia-fabricmanager-{branch}") };
    let f = match fm.as_slice() {
        [] if completed => Finding::pass(ID, "fabric completed on every GPU, though no fabric-manager package is installed")
            .detail("A fabric manager runs (the fabric completes only through one, and it does not start against another driver version); it was installed some other way, such as NVIDIA's runfile, so package upgrades will not keep it matched."),
        // The program is there though no package owns it (a runfile install, a copied binary):
        // installed, at a version nothing here can read without running it.
        [] if s.driver.fabric_manager_binary => Finding::unknown(ID, "/usr/bin/nv-fabricmanager is there, but no package says which version it is")
            .detail("A fabric manager was installed some other way than a package (NVIDIA's runfile, say); it must be exactly the driver's version, and the fabric is not completed, so nothing shows it is.")
            .remedy(format!("`nv-fabricmanager --version` must say {driver}; otherwise install `{name}={driver}-1` and hold it with the driver (`phq-agent install` does this).")),
        [] => Finding::fail(ID, "nvidia-fabricmanager is not installed")
            .detail("This VM sees NVSwitches, so it must run the fabric manager at exactly the driver's version.")
            .remedy(format!("Install `{name}={driver}-1` and hold it with the driver; `phq-agent install` does this.")),
        pkgs => {
            let wrong: Vec<String> = pkgs.iter().filter(|p| crate::collect::packages::upstream_version(&p.version) != driver).map(|p| format!("{} {}", p.name, p.version)).collect();
            if wrong.is_empty() {
                Finding::pass(ID, format!("{} matches driver {driver}", pkgs[0].name))
            } else {
                Finding::fail(ID, format!("fabric manager {} does not match driver {driver}", wrong.join(", ")))
                    .detail("The fabric manager refuses to start against a driver of another version, and CUDA then fails with error 802.")
                    .remedy(format!("Install `{name}={driver}-1` and hold both (`apt-mark hold`)."))
            }
        }
    };
    f.evidence("driver", driver)
        .evidence("packages", fm.iter().map(|p| format!("{} {}", p.name, p.version)).collect::<Vec<_>>())
}

use crate::snapshot::Fact;

fn fabric_state(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "fabric.state";
    if !has_nvswitches(s) {
        return Finding::pass(ID, "no NVSwitch in this VM: no fabric to join");
    }
    let f = match &g.fabric {
        Nv::Value(f) => f,
        other => return missing(ID, "fabric info", other),
    };
    let r = match (f.state, f.status.as_str()) {
        (FabricState::Completed, "NVML_SUCCESS") => Finding::pass(ID, format!("fabric completed (clique {})", f.clique_id)),
        (FabricState::Completed, status) => Finding::fail(ID, format!("fabric training finished with {status}"))
            .remedy("Check `journalctl -u nvidia-fabricmanager` for the failing NVSwitch or link; restart the VM, and report it to the platform if it repeats."),
        (FabricState::NotStarted, _) => Finding::fail(ID, "fabric not started: CUDA will fail with error 802")
            .detail("The GPU waits for the fabric manager to set up NVLink through the NVSwitches; until then cuInit returns 802 (system not yet initialized).")
            .remedy("`systemctl enable --now nvidia-fabricmanager` (installed at exactly the driver's version)."),
        (FabricState::InProgress, _) => Finding::warn(ID, "fabric training in progress").remedy("Wait a minute and run doctor again; if it stays in progress, read `journalctl -u nvidia-fabricmanager`."),
        (FabricState::NotSupported, _) => Finding::unknown(ID, "the GPU reports no fabric support although NVSwitches are visible"),
    };
    r.evidence("fabric", f)
}

fn links_active(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "nvlink.links-active";
    let links = match &g.nvlinks {
        Nv::Value(l) => l,
        Nv::NotSupported => return Finding::pass(ID, "no NVLink on this GPU (NVML reports none)"),
        other => return missing(ID, "NVLink state", other),
    };
    let active: Vec<u32> = links.iter().filter(|l| l.active == Nv::Value(true)).map(|l| l.link).collect();
    let inactive: Vec<u32> = links.iter().filter(|l| l.active == Nv::Value(false)).map(|l| l.link).collect();
    let f = if links.is_empty() {
        Finding::pass(ID, "no NVLink on this GPU")
    } else if inactive.is_empty() {
        Finding::pass(ID, format!("{}/{} NVLinks active", active.len(), links.len()))
    } else if active.is_empty() && !has_nvswitches(s) {
        Finding::pass(ID, "NVLink not in use in this VM (no NVSwitch passed through, none trained by the host)")
    } else {
        let list = inactive.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ");
        let summary = if active.is_empty() {
            format!("all {} NVLinks inactive", links.len())
        } else {
            format!("{} of {} NVLinks inactive (links {list})", inactive.len(), links.len())
        };
        Finding::fail(ID, summary)
            .detail(if active.is_empty() && has_nvswitches(s) {
                "No link trained: when the fabric is not started (see fabric.state), this is why; otherwise the GPU's NVLink is down."
            } else {
                "GPU↔GPU bandwidth drops with every link down, and NCCL collectives slow to the weakest GPU."
            })
            .remedy("Start the fabric manager if fabric.state says not_started; else restart the VM to retrain the links, and if they stay down report the GPU and links to the platform (`nvidia-smi nvlink -s` shows the same).")
    };
    f.evidence("active", active).evidence("inactive", inactive)
}

fn nvlink_errors(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "nvlink.errors";
    let links = match &g.nvlinks {
        Nv::Value(l) => l,
        Nv::NotSupported => return Finding::pass(ID, "no NVLink on this GPU"),
        other => return missing(ID, "NVLink error counters", other),
    };
    // DCGM's NVLink health watch treats any CRC, replay or recovery error as a warning.
    let mut bad = Vec::new();
    for l in links {
        let counters = [
            ("replay", &l.replay_errors),
            ("recovery", &l.recovery_errors),
            ("crc_flit", &l.crc_flit_errors),
            ("crc_data", &l.crc_data_errors),
        ];
        let nonzero: Vec<String> =
            counters.iter().filter_map(|(n, v)| v.value().filter(|c| **c > 0).map(|c| format!("{n} {c}"))).collect();
        if !nonzero.is_empty() {
            bad.push(format!("link {}: {}", l.link, nonzero.join(", ")));
        }
    }
    if bad.is_empty() {
        Finding::pass(ID, "no NVLink errors")
    } else {
        Finding::warn(ID, format!("NVLink errors on {} link(s)", bad.len()))
            .detail(bad.join("; "))
            .remedy("Watch whether the counters grow (`nvidia-smi nvlink -e`); growing recovery or replay errors mean a marginal link: report the GPU and link to the platform.")
            .evidence("links", bad)
    }
}

fn ecc_mode(_s: &Snapshot, g: &NvmlGpu) -> Finding {
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

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

fn ecc_uncorrectable(_s: &Snapshot, g: &NvmlGpu) -> Finding {
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
    } else if a.uncorrected > 0 {
        Finding::warn(ID, format!("{} uncorrectable ECC error(s) over the GPU's life, none since the last reset", a.uncorrected))
            .remedy("Check gpu.row-remap: if the rows were remapped the GPU is fine; if the lifetime count keeps growing, report the GPU.")
    } else {
        Finding::pass(ID, "no uncorrectable ECC errors")
    };
    f.evidence("volatile", v).evidence("aggregate", a)
}

fn row_remap(_s: &Snapshot, g: &NvmlGpu) -> Finding {
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

fn throttle(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.throttle";
    let reasons = match &g.throttle_reasons {
        Nv::Value(r) => r,
        other => return missing(ID, "clock-event reasons", other),
    };
    let class = |r: &str| {
        facts::THROTTLE_SEVERITY.iter().find(|(n, _)| *n == r).map(|(_, c)| *c).unwrap_or(ThrottleClass::Warn)
    };
    let worst = reasons.iter().map(|r| class(r)).max().unwrap_or(ThrottleClass::Normal);
    let active: Vec<&str> = reasons.iter().filter(|r| class(r) > ThrottleClass::Normal).map(String::as_str).collect();
    let f = match worst {
        ThrottleClass::Fail => Finding::fail(ID, format!("clocks held down by {}", active.join(", ")))
            .detail("Hardware slowdown halves (or worse) the GPU's clocks: the cooling or power delivery of the host is failing, or the GPU is far over temperature.")
            .remedy("Report the GPU and the reason to the platform (host cooling/power); move the workload meanwhile. See gpu.temperature."),
        ThrottleClass::Warn => Finding::warn(ID, format!("clocks reduced by {}", active.join(", ")))
            .remedy("The GPU is running hot enough for the driver to slow it: check gpu.temperature and report persistent throttling to the platform."),
        ThrottleClass::Normal => Finding::pass(ID, if reasons.is_empty() { "no clock-event reason active".to_string() } else { format!("only normal reasons: {}", reasons.join(", ")) }),
    };
    f.evidence("reasons", reasons)
}

fn temperature(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.temperature";
    let t = match &g.temperature_c {
        Nv::Value(t) => *t,
        other => return missing(ID, "temperature", other),
    };
    let slowdown = g.slowdown_temperature_c.value().copied();
    let f = match slowdown {
        Some(sd) if t >= sd => Finding::fail(ID, format!("{t} °C, at or above the slowdown threshold {sd} °C"))
            .remedy("The host's cooling is not keeping up: report the GPU to the platform; the GPU is throttling."),
        Some(sd) if t + facts::TEMPERATURE_MARGIN_C >= sd => {
            Finding::warn(ID, format!("{t} °C, within {} °C of slowdown at {sd} °C", facts::TEMPERATURE_MARGIN_C))
                .remedy("Watch it under load; report to the platform if it reaches the slowdown threshold.")
        }
        Some(sd) => Finding::pass(ID, format!("{t} °C (slowdown at {sd} °C)")),
        None => Finding::pass(ID, format!("{t} °C (NVML gives no slowdown threshold to compare)")),
    };
    f.evidence("temperature_c", t).evidence("slowdown_c", slowdown).evidence("shutdown_c", &g.shutdown_temperature_c)
}

fn power_limit(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.power-limit";
    let (limit, default) = match (&g.power_limit_mw, &g.default_power_limit_mw) {
        (Nv::Value(l), Nv::Value(d)) => (*l, *d),
        (Nv::Value(_), other) | (other, _) => return missing(ID, "power limits", other),
    };
    let f = if limit < default {
        Finding::warn(ID, format!("power capped at {} W of the default {} W", limit / 1000, default / 1000))
            .detail("A lower power limit caps clocks under load: compute throughput drops with it.")
            .remedy(format!("Restore it with `nvidia-smi -i <gpu> -pl {}` if the VM may; otherwise ask the platform why the GPU is capped.", default / 1000))
    } else {
        Finding::pass(ID, format!("{} W enforced (default {} W)", limit / 1000, default / 1000))
    };
    f.evidence("enforced_mw", limit).evidence("default_mw", default).evidence("usage_mw", &g.power_usage_mw)
}

fn pcie_link(_s: &Snapshot, g: &NvmlGpu) -> Finding {
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

fn pcie_replay(s: &Snapshot, g: &NvmlGpu) -> Finding {
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

fn mig_pending(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.mig-pending";
    match &g.mig_mode {
        Nv::Value(m) if m.current != m.pending => Finding::warn(ID, format!("MIG {} now, {} after the next GPU reset", on_off(m.current), on_off(m.pending)))
            .remedy("Reset the GPU (restart the VM) to apply the pending MIG mode, or set it back (`nvidia-smi -i <gpu> -mig 0|1`)."),
        Nv::Value(m) => Finding::pass(ID, format!("MIG {}, nothing pending", on_off(m.current))),
        other => missing(ID, "MIG mode", other),
    }
    .evidence("mig", &g.mig_mode)
}

fn inforom(_s: &Snapshot, g: &NvmlGpu) -> Finding {
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
    use super::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    fn findings(s: &Snapshot) -> Vec<Finding> {
        let mut out = Vec::new();
        run(s, &mut out);
        out
    }

    fn gpu_mut(s: &mut Snapshot, i: usize) -> &mut NvmlGpu {
        match &mut s.nvml {
            NvmlStatus::Ok(n) => &mut n.devices[i],
            _ => unreachable!(),
        }
    }

    fn bad(f: &[Finding]) -> Vec<(String, String, Severity)> {
        f.iter()
            .filter(|f| f.severity >= Severity::Warn)
            .map(|f| (f.id.clone(), f.gpu.clone().unwrap_or_default(), f.severity))
            .collect()
    }

    #[test]
    fn healthy_has_no_alarm() {
        assert_eq!(bad(&findings(&healthy())), vec![]);
        assert!(findings(&healthy()).iter().all(|f| f.severity == Severity::Pass), "{:#?}", findings(&healthy()));
    }

    #[test]
    fn fabric_not_started_says_802_and_how_to_start() {
        let mut s = healthy();
        for i in 0..8 {
            if let Nv::Value(f) = &mut gpu_mut(&mut s, i).fabric {
                f.state = FabricState::NotStarted;
            }
        }
        let f = findings(&s);
        let m = find(&f, "fabric.manager-running")[0];
        assert_eq!(m.severity, Severity::Fail);
        assert!(m.detail.contains("802"));
        assert!(m.remedy.as_ref().unwrap().contains("systemctl enable --now nvidia-fabricmanager"));
        assert_eq!(find(&f, "fabric.state").iter().filter(|x| x.severity == Severity::Fail).count(), 8);
    }

    #[test]
    fn no_nvswitch_passes_fabric_with_reason() {
        let mut s = healthy();
        if let Fact::Value(d) = &mut s.pci {
            d.retain(|d| !d.is_nvswitch());
        }
        for i in 0..8 {
            gpu_mut(&mut s, i).fabric = Nv::Value(FabricInfo {
                state: FabricState::NotSupported,
                status: "NVML_SUCCESS".into(),
                clique_id: 0,
                cluster_uuid: String::new(),
            });
        }
        // A fabric manager left enabled without NVSwitches fails at every boot: say so.
        let f = findings(&s);
        let m = find(&f, "fabric.manager-running")[0];
        assert_eq!(m.severity, Severity::Warn);
        assert!(m.remedy.as_ref().unwrap().contains("systemctl disable --now nvidia-fabricmanager"));
        // Not installed (as it should be): everything fabric passes, saying why.
        if let Fact::Value(units) = &mut s.units {
            units[1] = UnitState {
                name: "nvidia-fabricmanager.service".into(),
                load_state: "not-found".into(),
                active_state: "inactive".into(),
                sub_state: "dead".into(),
                unit_file_state: String::new(),
            };
        }
        let f = findings(&s);
        for id in ["fabric.manager-running", "fabric.manager-version", "fabric.state"] {
            assert!(
                find(&f, id).iter().all(|x| x.severity == Severity::Pass && x.summary.contains("NVSwitch")),
                "{id}"
            );
        }
    }

    #[test]
    fn failed_fabric_manager_unit_points_at_its_journal() {
        let mut s = healthy();
        if let Fact::Value(units) = &mut s.units {
            units[1].active_state = "failed".into();
            units[1].sub_state = "failed".into();
        }
        let f = findings(&s);
        let m = find(&f, "fabric.manager-running")[0];
        assert_eq!(m.severity, Severity::Fail);
        assert_eq!(m.summary, "nvidia-fabricmanager is failed (failed)");
        assert!(m.remedy.as_ref().unwrap().contains("journalctl -u nvidia-fabricmanager"));
    }

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
    fn degraded_pcie_and_hw_thermal() {
        let mut s = healthy();
        let g = gpu_mut(&mut s, 5);
        g.pcie.width_current = Nv::Value(8);
        g.pcie.gen_current = Nv::Value(3);
        g.throttle_reasons = Nv::Value(vec!["hw_thermal_slowdown".into(), "sw_power_cap".into()]);
        g.temperature_c = Nv::Value(89);
        let mut got = bad(&findings(&s));
        got.sort();
        let addr = "0000:0e:00.0".to_string();
        assert_eq!(
            got,
            vec![
                ("gpu.pcie-link".into(), addr.clone(), Severity::Fail),
                ("gpu.temperature".into(), addr.clone(), Severity::Fail),
                ("gpu.throttle".into(), addr, Severity::Fail)
            ]
        );
    }

    #[test]
    fn inactive_links_are_listed() {
        let mut s = healthy();
        if let Nv::Value(l) = &mut gpu_mut(&mut s, 1).nvlinks {
            l[4].active = Nv::Value(false);
            l[11].active = Nv::Value(false);
        }
        let f = findings(&s);
        let x = find(&f, "nvlink.links-active").into_iter().find(|f| f.severity == Severity::Fail).unwrap();
        assert_eq!(x.summary, "2 of 18 NVLinks inactive (links 4, 11)");
        assert_eq!(x.gpu.as_deref(), Some("0000:0a:00.0"));
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
            assert!(f.iter().filter(|f| f.id != "nvml.init").all(|f| f.severity == Severity::Unknown));
        }
    }

    #[test]
    fn fabric_manager_version_must_match() {
        let mut s = healthy();
        s.packages = Fact::Value(vec![Package {
            name: "nvidia-fabricmanager".into(),
            version: "580.65.06-1".into(),
            state: "installed".into(),
            held: false,
        }]);
        assert_eq!(find(&findings(&s), "fabric.manager-version")[0].severity, Severity::Fail);
        // No package, no program and no completed fabric: nothing runs it.
        s.packages = Fact::Value(vec![]);
        s.driver.fabric_manager_binary = false;
        for i in 0..8 {
            if let Nv::Value(f) = &mut gpu_mut(&mut s, i).fabric {
                f.state = FabricState::NotStarted;
            }
        }
        let f = findings(&s);
        let v = find(&f, "fabric.manager-version")[0];
        assert_eq!(v.severity, Severity::Fail);
        assert!(v.remedy.as_ref().unwrap().contains("nvidia-fabricmanager=580.82.07-1"));
    }

    /// Absence is claimed only from evidence: a completed fabric proves a matching fabric
    /// manager runs, with or without a package (a runfile install) or a package database.
    #[test]
    fn fabric_manager_judged_from_the_fabric_when_packages_cannot_tell() {
        let mut s = healthy();
        s.packages = Fact::Value(vec![]);
        assert_eq!(
            find(&findings(&s), "fabric.manager-version")[0].severity,
            Severity::Pass,
            "runfile install, fabric completed"
        );
        s.packages = Fact::Error("no package database".into());
        let f = findings(&s);
        let v = find(&f, "fabric.manager-version")[0];
        assert_eq!(v.severity, Severity::Pass, "{v:?}");
        assert!(v.detail.contains("no package database"), "{v:?}");
        if let Nv::Value(f) = &mut gpu_mut(&mut s, 2).fabric {
            f.state = FabricState::InProgress;
        }
        let f = findings(&s);
        let v = find(&f, "fabric.manager-version")[0];
        assert_eq!(v.severity, Severity::Unknown, "no database and no completed fabric: {v:?}");
        // A readable database without the package, the fabric not completed: "not installed"
        // only when the program is not there either.
        s.packages = Fact::Value(vec![]);
        s.driver.fabric_manager_binary = false;
        assert_eq!(find(&findings(&s), "fabric.manager-version")[0].severity, Severity::Fail);
        s.driver.fabric_manager_binary = true;
        let f = findings(&s);
        let v = find(&f, "fabric.manager-version")[0];
        assert_eq!(v.severity, Severity::Unknown, "the program is there: {v:?}");
        assert!(v.summary.contains("/usr/bin/nv-fabricmanager is there"), "{v:?}");
    }

    #[test]
    fn replay_rate_against_the_dcgm_budget() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).pcie.replay_counter = Nv::Value(100);
        assert_eq!(find(&findings(&s), "gpu.pcie-replay")[0].severity, Severity::Pass);
        gpu_mut(&mut s, 0).pcie.replay_counter = Nv::Value(60 * 40);
        assert_eq!(find(&findings(&s), "gpu.pcie-replay")[0].severity, Severity::Warn);
    }

    fn one(s: &Snapshot, id: &str) -> Finding {
        findings(s).into_iter().find(|f| f.id == id && f.gpu.as_deref() == Some("0000:09:00.0")).unwrap()
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

    #[test]
    fn temperature_bands() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).temperature_c = Nv::Value(83);
        assert_eq!(one(&s, "gpu.temperature").severity, Severity::Warn);
        gpu_mut(&mut s, 0).temperature_c = Nv::Value(87);
        assert_eq!(one(&s, "gpu.temperature").severity, Severity::Fail);
        gpu_mut(&mut s, 0).slowdown_temperature_c = Nv::NotSupported;
        assert_eq!(one(&s, "gpu.temperature").severity, Severity::Pass);
    }

    #[test]
    fn sw_thermal_warns_power_cap_passes() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).throttle_reasons = Nv::Value(vec!["sw_power_cap".into()]);
        assert_eq!(one(&s, "gpu.throttle").severity, Severity::Pass);
        gpu_mut(&mut s, 0).throttle_reasons = Nv::Value(vec!["sw_thermal_slowdown".into()]);
        assert_eq!(one(&s, "gpu.throttle").severity, Severity::Warn);
    }

    #[test]
    fn capped_power_limit_warns() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).power_limit_mw = Nv::Value(500_000);
        let f = one(&s, "gpu.power-limit");
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.summary, "power capped at 500 W of the default 700 W");
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

    #[test]
    fn nvlink_error_counters_warn_per_link() {
        let mut s = healthy();
        if let Nv::Value(l) = &mut gpu_mut(&mut s, 0).nvlinks {
            l[3].crc_flit_errors = Nv::Value(12);
        }
        let f = one(&s, "nvlink.errors");
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.detail, "link 3: crc_flit 12");
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
