//! The driver and what belongs to it: kernel headers and the kernel hold for DKMS, nouveau
//! off, the driver's packages (kept, matched, or replaced as `Choices` decided), the MOK
//! enrolment under Secure Boot, nvidia-persistenced, and fabric manager at exactly the driver's
//! version where NVSwitches are visible.

use super::choices::{Choices, InstalledDriver};
use super::{
    apt, cmd, dnf, lits, on, Action, Arg, Distro, Draft, Facts, Step, StepId, DEBIAN_PIN_PATH, DKMS_MOK, DOWNLOAD_DIR,
    MOK_PASSWORD_FILE, NOUVEAU_CONF, NOUVEAU_CONF_TEXT,
};
use crate::checks::Finding;

/// Headers, kernel hold, nouveau, driver, MOK, persistence daemon, fabric manager.
pub(super) fn add(d: &mut Draft, f: &Facts, c: &Choices) {
    let (distro, kernel) = (&c.distro, &c.kernel);
    // 2. Kernel headers: DKMS builds the modules against them (`Choices` says which).
    d.steps.push(headers_step(c));

    // 2b. Debian and Ubuntu with a DKMS-built driver: the running kernel is held before the
    // driver is built for it, so unattended-upgrades cannot install another kernel mid-install
    // (its dpkg runs wait on the same lock, DPkg::Lock::Timeout). EL locks the kernel with the
    // other packages at the end (dnf versionlock needs its plugin installed first).
    if distro.is_deb() && !c.kernel_hold.is_empty() {
        let packages = f.packages.as_deref().unwrap_or(&[]);
        let held = c.kernel_hold.iter().all(|k| packages.iter().any(|p| &p.name == k && p.held));
        d.steps.push(Step {
            id: StepId::KernelHold,
            title: format!("hold kernel {kernel} while the driver's module is built for it"),
            actions: vec![Action::Run(on(cmd("apt-mark", &["hold"]), &c.kernel_hold))],
            done: held.then(|| format!("kernel {kernel} is held")),
            needs_reboot: false,
        });
    }

    // 3. nouveau off, in the initramfs too.
    // Every installed kernel's initramfs, not only the running one's: a newer kernel booted
    // later must not bring nouveau back (update-initramfs(8): `-k all`; dracut(8):
    // `--regenerate-all`).
    let initramfs = if distro.is_deb() {
        cmd("update-initramfs", &["-u", "-k", "all"])
    } else {
        cmd("dracut", &["--force", "--regenerate-all"])
    };
    d.steps.push(Step {
        id: StepId::Nouveau,
        title: "blacklist nouveau and rebuild the initramfs".into(),
        actions: vec![
            Action::Write { path: NOUVEAU_CONF.into(), contents: NOUVEAU_CONF_TEXT.into() },
            Action::Run(initramfs),
        ],
        done: f.nouveau_off.then(|| "nouveau is blacklisted with modeset=0".into()),
        needs_reboot: f.nouveau_loaded,
    });

    // 4–6. Driver, persistence daemon, fabric manager.
    // Secure Boot without a distribution-signed build (Debian, EL): DKMS signs the module with
    // its own key, which the firmware trusts once a person confirms its enrolment at the console
    // (the dkms README, "Secure Boot": `mokutil --import`, reboot, "Enroll MOK" in shim's MOK
    // manager). The install queues the enrolment; the boot-safety gate stops short of the
    // reboot until it is confirmed, and says how. On EL9 NVIDIA's precompiled module streams
    // (`latest`, `<branch>`: `kmod-nvidia-<driver>-<kernel>`) are the proprietary flavour; the
    // open modules come only as DKMS streams (`<branch>-open`: `kmod-nvidia-open-dkms`), as
    // NVIDIA's yum-packaging-dkms-nvidia README lists them, so this is the path there too.
    if c.dkms_under_sb {
        d.findings.push(
            Finding::warn(
                "install.secure-boot",
                "Secure Boot is on: DKMS signs the driver's module with its own key, which the firmware trusts only once it is enrolled",
            )
            .detail(format!(
                "{} has no NVIDIA modules signed by a key its shim already trusts. The install queues DKMS's key ({DKMS_MOK}) \
                 for enrolment with a one-time password; a person confirms it once, at the VM console, in the MOK manager \
                 that starts on the next boot.",
                c.distro.name()
            ))
            .remedy(format!(
                "When the install stops at the reboot: read the password (sudo cat {DOWNLOAD_DIR}/{MOK_PASSWORD_FILE}), open \
                 the VM's console (virtctl vnc), reboot, choose Enroll MOK → Continue → Yes, type the password, reboot; the \
                 install resumes. Or turn Secure Boot off for this VM (KubeVirt: \
                 spec.domain.firmware.bootloader.efi.secureBoot: false)."
            )),
        );
    }
    if c.kept.is_none() {
        d.steps.push(driver_step(f, c));
    }
    if c.dkms_under_sb {
        d.steps.push(mok_step(f, distro));
    }
    d.steps.push(Step {
        id: StepId::Persistenced,
        title: "enable nvidia-persistenced".into(),
        actions: vec![Action::Run(cmd("systemctl", &["enable", "nvidia-persistenced.service"]))],
        done: f.unit_enabled("nvidia-persistenced.service").then(|| "nvidia-persistenced is enabled".into()),
        needs_reboot: false,
    });

    fabric_manager(d, f, c);
}

/// The headers DKMS builds against: Debian's flavour metas, else the running kernel's own.
fn headers_step(c: &Choices) -> Step {
    let (distro, kernel) = (&c.distro, &c.kernel);
    match &c.headers.flavour_metas {
        Some((fl, metas)) => Step {
            id: StepId::Headers,
            title: format!("kernel headers of the {fl} flavour: its newest kernel and headers ({})", metas.join(", ")),
            actions: vec![Action::Run(apt("install", lits(metas)))],
            done: c.headers.done.clone(),
            needs_reboot: false,
        },
        None => Step {
            id: StepId::Headers,
            title: format!("kernel headers for {kernel}"),
            actions: vec![Action::Run(if distro.is_deb() {
                apt("install", lits(&c.headers.packages))
            } else {
                on(dnf(&["install"]), &c.headers.packages)
            })],
            done: c.headers.done.clone(),
            needs_reboot: false,
        },
    }
}

/// Under Secure Boot with DKMS: mokutil, and DKMS's key queued for enrolment.
fn mok_step(f: &Facts, distro: &Distro) -> Step {
    let mokutil =
        if distro.is_deb() { apt("install", lits(&["mokutil".into()])) } else { dnf(&["install", "mokutil"]) };
    Step {
        id: StepId::Mok,
        title: format!("queue DKMS's signing key ({DKMS_MOK}) for enrolment, so Secure Boot trusts the module"),
        actions: vec![Action::Run(mokutil), Action::EnrollMok { key: DKMS_MOK.into() }],
        // Under Secure Boot the kernel loads only modules whose signer the firmware or the
        // MOK list trusts (kernel lockdown), so a loaded nvidia module proves the key is in.
        done: f
            .nvidia_loaded
            .as_ref()
            .map(|v| format!("nvidia {v} is loaded under Secure Boot, so its signing key is trusted")),
        needs_reboot: false,
    }
}

/// The driver's packages, after the old branch's when one is being replaced.
fn driver_step(f: &Facts, c: &Choices) -> Step {
    let (distro, b, kernel) = (&c.distro, c.branch, &c.kernel);
    let mut actions = match &c.replacing {
        Some(old) => remove(old, f, c),
        None => Vec::new(),
    };
    // EL: rpm records a package before its %post runs (rpm's install order: files, database,
    // then %post), and the DKMS build is in kmod-nvidia-open-dkms's %post (NVIDIA's
    // yum-packaging-dkms-nvidia spec: `dkms add`, `dkms build`, `dkms install`). A %post
    // killed or failed (headers missing) leaves the package installed without a module,
    // which `dnf install` then calls done; `dnf reinstall` runs the %post again (dnf(8):
    // reinstall). Debian's dpkg keeps such a package half-configured instead (the repair
    // step). The real-dnf test's kill inside the %post found it.
    let unbuilt = c.matching.as_ref().filter(|d| !distro.is_deb() && f.installed(&d.package) && !f.nvidia_module_built);
    match distro {
        _ if unbuilt.is_some() => {
            actions.push(Action::Run(dnf(&["reinstall", &c.driver_package])));
        }
        // NVIDIA's own branch lock is in place from the pin step.
        _ if c.pinning.is_some() => actions.push(Action::Run(apt("install", lits(&c.driver_packages)))),
        Distro::Debian12 => {
            actions.push(Action::Write { path: DEBIAN_PIN_PATH.into(), contents: debian_pin(b) });
            actions.push(Action::Run(apt("install", lits(&c.driver_packages))));
        }
        // NVIDIA's Driver Installation Guide (R620 edition, "Open GPU Kernel Modules
        // Installation", a specific branch on RHEL 9 and its rebuilds): enable the branch's
        // open stream, then install its packages — the compute-only set, not `nvidia-open`.
        Distro::El9(_) => {
            if c.replacing.is_none() {
                actions.push(Action::Run(dnf(&["module", "enable", &format!("nvidia-driver:{b}-open")])));
            }
            actions.push(Action::Run(on(dnf(&["install"]), &c.driver_packages)));
        }
        _ => actions.push(Action::Run(apt("install", lits(&c.driver_packages)))),
    }
    let done = c
        .present
        .as_ref()
        .filter(|d| d.branch == Some(b) && d.open && f.installed(&d.package))
        .filter(|_| unbuilt.is_none())
        .filter(|_| {
            c.pinning.is_some() || !matches!(distro, Distro::Debian12) || f.file_is(DEBIAN_PIN_PATH, &debian_pin(b))
        })
        .map(|d| format!("{} {} is installed", d.package, d.version));
    let title = match (distro, c.secure_boot) {
        (Distro::Ubuntu2204 | Distro::Ubuntu2404, true) => {
            format!("driver {b} with open kernel modules, Ubuntu's signed build for {kernel} (Secure Boot is on)")
        }
        _ => format!("driver {b} with open kernel modules"),
    };
    Step { id: StepId::Driver, title, actions, done, needs_reboot: true }
}

/// What goes before the new branch's driver: the old one, and its fabric manager and locks.
fn remove(old: &InstalledDriver, f: &Facts, c: &Choices) -> Vec<Action> {
    let (distro, b) = (&c.distro, c.branch);
    let packages = f.packages.as_deref().unwrap_or(&[]);
    let mut actions = Vec::new();
    let old_pkgs: Vec<String> = packages
        .iter()
        .filter(|p| {
            p.name == old.package
                || (p.name.starts_with("nvidia-fabricmanager")
                    || p.name.starts_with("libnvidia-nscq")
                    || p.name.starts_with("nvidia-fabric-manager"))
        })
        .map(|p| p.name.clone())
        .collect();
    if distro.is_deb() {
        actions.push(Action::Run(on(cmd("apt-mark", &["unhold"]), &old_pkgs)));
        actions.push(Action::Run(apt("purge", lits(&old_pkgs))));
    } else {
        // The old branch's version locks go, then the module moves to the new stream,
        // erasing what only the old stream allowed (dnf module switch-to, DNF's
        // modularity documentation). Every NVIDIA lock goes, not only the driver's and
        // fabric manager's: real dnf left `nvidia-driver-cuda`'s 580 lock behind after
        // a switch to 590 (tests/install_el9.rs). Only locks that are there: a run
        // killed after the delete finds none and goes on to the switch.
        let locked: Vec<String> = packages
            .iter()
            .filter(|p| p.held && ["nvidia", "kmod-nvidia", "libnvidia"].iter().any(|n| p.name.starts_with(n)))
            .map(|p| p.name.clone())
            .collect();
        if !locked.is_empty() {
            actions.push(Action::Run(on(cmd("dnf", &["versionlock", "delete"]), &locked)));
        }
        actions.push(Action::Run(dnf(&["module", "switch-to", &format!("nvidia-driver:{b}-open"), "--allowerasing"])));
    }
    actions
}

/// Fabric manager at exactly the driver's version with NVSwitches; off without them.
fn fabric_manager(d: &mut Draft, f: &Facts, c: &Choices) {
    let distro = &c.distro;
    let (fm, nscq) = &c.fabric_manager;
    let fm_installed = f.package(fm);
    if f.nvswitches > 0 {
        let driver_version = c.kept.as_ref().or(c.present.as_ref()).map(|d| d.version.clone());
        let fm_matches = fm_installed.is_some_and(|p| {
            p.state == "installed"
                && driver_version.as_deref() == Some(crate::collect::packages::upstream_version(&p.version))
        });
        let mut install = if distro.is_deb() { apt("install", Vec::new()) } else { dnf(&["install"]) };
        install.args.push(Arg::AtDriverVersion(fm.clone()));
        install.args.push(Arg::AtDriverVersion(nscq.clone()));
        d.steps.push(Step {
            id: StepId::FabricManager,
            title: format!(
                "{fm} at exactly the driver's version, enabled ({} NVSwitch{} visible)",
                f.nvswitches,
                if f.nvswitches == 1 { "" } else { "es" }
            ),
            actions: vec![
                Action::Run(install),
                Action::Run(cmd("systemctl", &["enable", "nvidia-fabricmanager.service"])),
            ],
            // A driver being replaced takes its fabric manager's match with it.
            done: (fm_matches && c.replacing.is_none() && f.unit_enabled("nvidia-fabricmanager.service"))
                .then(|| format!("{fm} matches the driver and is enabled")),
            needs_reboot: false,
        });
    } else if f.nvswitches == 0 && f.unit_enabled("nvidia-fabricmanager.service") {
        d.steps.push(Step {
            id: StepId::FabricManagerOff,
            title: "disable nvidia-fabricmanager: this VM sees no NVSwitch, so it can only fail".into(),
            actions: vec![Action::Run(cmd("systemctl", &["disable", "nvidia-fabricmanager.service"]))],
            done: None,
            needs_reboot: false,
        });
    }
}

/// Debian's `cuda-drivers` meta package would take the newest branch; this keeps every NVIDIA
/// driver package on the configured one.
fn debian_pin(b: u32) -> String {
    format!(
        "# Written by phq-agent install: keep the NVIDIA driver on branch {b}.\nPackage: nvidia-* libnvidia-* libcuda* libxnvctrl* cuda-drivers* firmware-nvidia-*\nPin: version {b}.*\nPin-Priority: 1000\n"
    )
}
