//! What finishes the install: version holds, so an unattended upgrade cannot split driver,
//! fabric manager and toolkit; the reboot a step needs; the doctor's checks. Also what the
//! plan as a whole leaves unknown (no GPU, packages that could not be listed).

use super::choices::Choices;
use super::{cmd, dnf, on, Action, Draft, Facts, Step, StepId};
use crate::checks::Finding;

/// Holds, reboot and verification; returns why a reboot is due even if no step runs.
pub(super) fn add(d: &mut Draft, f: &Facts, c: &Choices) -> Option<String> {
    let distro = &c.distro;
    // 8. Holds, so an unattended upgrade cannot split driver, fabric manager and toolkit.
    let mut hold: Vec<String> = Vec::new();
    if distro.is_deb() {
        // Not the per-kernel module packages: a new kernel brings its own through the meta.
        hold.extend(
            c.driver_packages
                .iter()
                .filter(|p| !p.starts_with("linux-modules-") && !p.starts_with("linux-signatures-"))
                .cloned(),
        );
        if let Some(kept) = &c.kept {
            hold.push(kept.package.clone());
        }
    } else {
        hold.extend(c.driver_packages.iter().cloned());
        if let Some(kept) = &c.kept {
            hold.push(kept.package.clone());
        }
    }
    if f.nvswitches > 0 {
        hold.extend([c.fabric_manager.0.clone(), c.fabric_manager.1.clone()]);
    }
    // A DKMS module is built for the kernels present when it is installed (Debian and Ubuntu
    // hold the kernel in their own step, before the driver); Ubuntu's signed path instead
    // brings each new kernel's module through the flavour's meta package.
    if !distro.is_deb() {
        hold.extend(c.kernel_hold.iter().cloned());
    }
    if c.cuda_runs {
        hold.push(c.toolkit.clone());
    }
    if !hold.is_empty() {
        let all_held =
            f.packages.as_ref().is_ok_and(|ps| hold.iter().all(|h| ps.iter().any(|p| &p.name == h && p.held)));
        let actions = if distro.is_deb() {
            vec![Action::Run(on(cmd("apt-mark", &["hold"]), &hold))]
        } else {
            vec![
                Action::Run(dnf(&["install", "python3-dnf-plugin-versionlock"])),
                Action::Run(on(cmd("dnf", &["versionlock", "add"]), &hold)),
            ]
        };
        d.steps.push(Step {
            id: StepId::Hold,
            title: format!("hold versions: {}", hold.join(", ")),
            actions,
            // After a driver is replaced its holds are the old versions' (or gone): hold again.
            done: (all_held && c.replacing.is_none()).then(|| "all held".into()),
            needs_reboot: false,
        });
    }

    // 9–10. Reboot when needed, then verify with the doctor's checks.
    let reboot_reason = match (&c.present, &f.nvidia_loaded) {
        _ if f.gpus == 0 => None,
        (Some(d), Some(loaded)) if c.kept.is_some() || d.branch == Some(c.branch) => {
            (crate::collect::packages::upstream_version(loaded) != d.version)
                .then(|| format!("driver {} is installed but {loaded} is loaded", d.version))
        }
        (Some(d), None) => Some(format!("driver {} is installed but not loaded", d.version)),
        _ => None,
    };
    let pending_reboot = d.steps.iter().any(|s| s.done.is_none() && s.needs_reboot);
    d.steps.push(Step {
        id: StepId::Reboot,
        title: "reboot if a step needs it".into(),
        actions: vec![Action::Reboot],
        done: (!pending_reboot && reboot_reason.is_none())
            .then(|| "no step changes the modules or the initramfs, and the loaded driver is the installed one".into()),
        needs_reboot: false,
    });
    d.steps.push(Step {
        id: StepId::Verify,
        title: "verify with the doctor's checks".into(),
        actions: vec![Action::Verify],
        done: None,
        needs_reboot: false,
    });

    if f.gpus == 0 {
        d.findings.push(
            Finding::warn(
                "install.no-gpu",
                "no NVIDIA GPU is visible: the driver is installed, but nothing will use it yet",
            )
            .remedy("Check the VM spec's gpus[] / hostDevices, then run phq-agent doctor"),
        );
    }
    if let Err(e) = &f.packages {
        d.findings.push(Finding::unknown(
            "install.packages",
            format!("installed packages unknown ({e}): every package step runs"),
        ));
    }
    reboot_reason
}
