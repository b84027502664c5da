//! The NVSwitch fabric: fabric.manager-running, fabric.manager-version (once per VM) and
//! fabric.state (per GPU, from NVML). The NVLinks themselves are `nvlink`'s.

use super::{gpu_label, has_nvswitches, missing, Finding};
use crate::facts;
use crate::snapshot::{FabricState, Fact, Nv, NvmlGpu, Snapshot};

const FABRIC_MANAGER: &str = "nvidia-fabricmanager.service";

pub(super) fn manager_running(s: &Snapshot) -> Finding {
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

pub(super) fn manager_version(s: &Snapshot) -> Finding {
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

pub(super) fn fabric_state(s: &Snapshot, g: &NvmlGpu) -> Finding {
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

/// The evidence key that names a finding's cause: another check id, whose route it then takes
/// (`route` rule 5).
pub const CAUSED_BY: &str = "caused_by";

/// One cause, one owner (issue 51): while the fabric manager is not running
/// (`fabric.manager-running` fails: absent, failed or stopped — the tenant's to start), the
/// NVSwitch fabric is never trained, so each GPU's `fabric.state` stays `not_started` and its
/// NVLinks inactive (NVIDIA's Fabric Manager User Guide: the fabric manager trains the GPU and
/// NVSwitch NVLinks, and CUDA waits for it with error 802). Those findings then share the
/// manager's cause and route as it does; the same findings with the manager running stay the
/// platform's (a fabric that will not train, links that will not come up).
pub(super) fn one_cause(out: &mut [Finding]) {
    use super::Severity;
    let manager_down = out.iter().any(|f| f.id == "fabric.manager-running" && f.severity == Severity::Fail);
    if !manager_down {
        return;
    }
    for f in out.iter_mut().filter(|f| matches!(f.severity, Severity::Warn | Severity::Fail)) {
        let untrained = match f.id.as_str() {
            "fabric.state" => {
                f.evidence.get("fabric").and_then(|x| x.get("state")).and_then(serde_json::Value::as_str)
                    == Some("not_started")
            }
            "nvlink.links-active" => true,
            _ => false,
        };
        if !untrained {
            continue;
        }
        f.evidence.insert(CAUSED_BY.into(), "fabric.manager-running".into());
        f.detail = format!(
            "{}\nThe fabric manager is not running (fabric.manager-running): until it runs, the NVSwitch fabric is not trained and the NVLinks stay inactive, so this follows from it and is the guest's to fix first. It is the platform's only if it stays so with the fabric manager running.",
            f.detail
        )
        .trim_start()
        .to_string();
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

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
}
