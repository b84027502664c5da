//! driver.* (the checks that need no NVML) and the CUDA toolkit checks that only need files.

use super::{Finding, Settings};
use crate::facts::{self, MIN_DRIVER_BRANCH};
use crate::snapshot::{Fact, Snapshot};

pub fn run(s: &Snapshot, settings: &Settings, out: &mut Vec<Finding>) {
    out.push(nouveau_disabled(s));
    out.push(module_loaded(s));
    out.push(open_kernel_module(s));
    out.push(version_consistent(s));
    out.push(branch_supported(s, settings));
    out.push(kernel_taint(s));
    out.push(next_kernel(s));
    out.push(device_nodes(s));
    out.push(cuda_toolkit(s, settings));
    out.push(toolkit_driver_compatible(s));
}

/// The version of the loaded kernel module, from /proc or /sys.
fn module_version(s: &Snapshot) -> Option<String> {
    s.driver.nvrm.value().map(|v| v.version.clone()).or_else(|| s.driver.module_version.clone())
}

fn nvidia_loaded(s: &Snapshot) -> Option<bool> {
    s.driver.modules.value().map(|m| m.iter().any(|n| n == "nvidia"))
}

/// A check that cannot say anything because the module is not loaded: unknown when there are
/// GPUs (driver.module-loaded carries the failure), a pass when there is nothing to drive.
fn without_module(s: &Snapshot, id: &str) -> Finding {
    if s.gpus().is_empty() {
        Finding::pass(id, "no NVIDIA GPU: nothing to check")
    } else {
        match (nvidia_loaded(s), s.driver.nvrm.error()) {
            (Some(false), _) => Finding::unknown(id, "the nvidia kernel module is not loaded"),
            (_, Some(e)) => Finding::unknown(id, format!("the nvidia kernel module's version is unknown: {e}")),
            _ => Finding::unknown(id, "the nvidia kernel module reports no version"),
        }
    }
}

fn nouveau_disabled(s: &Snapshot) -> Finding {
    const ID: &str = "driver.nouveau-disabled";
    let modules = match &s.driver.modules {
        Fact::Value(m) => m,
        Fact::Error(e) => return Finding::unknown(ID, format!("cannot list loaded modules: {e}")),
    };
    let cfg = &s.driver.nouveau;
    let f = if modules.iter().any(|m| m == "nouveau") {
        let held: Vec<&str> =
            s.gpus().iter().filter(|g| g.driver.as_deref() == Some("nouveau")).map(|g| g.address.as_str()).collect();
        Finding::fail(ID, "nouveau is loaded")
            .detail(if held.is_empty() { "It holds no GPU right now but will compete with nvidia for them.".to_string() } else { format!("It holds {} GPU(s): {}.", held.len(), held.join(", ")) })
            .remedy("Blacklist nouveau: /etc/modprobe.d/blacklist-nouveau.conf with `blacklist nouveau` and `options nouveau modeset=0`, then `update-initramfs -u` (or `dracut --force`) and reboot. `phq-agent install` does this.")
    } else if !cfg.blacklisted_in.is_empty() {
        Finding::pass(ID, format!("not loaded; blacklisted in {}", cfg.blacklisted_in.join(", ")))
    } else if s.driver.nouveau_module_available == Some(false) {
        Finding::pass(ID, "not loaded; this kernel has no nouveau module")
    } else if s.gpus().is_empty() {
        Finding::pass(ID, "not loaded; no NVIDIA GPU for it to claim")
    } else if nvidia_loaded(s) == Some(true) {
        Finding::pass(ID, "not loaded (nvidia holds the GPUs), but not blacklisted either")
            .detail("If the nvidia module ever fails to load first, nouveau will claim the GPUs at boot; `phq-agent install` writes the blacklist.")
    } else {
        Finding::warn(ID, "not loaded now, but not blacklisted: it can claim the GPUs at the next boot")
            .remedy("Write /etc/modprobe.d/blacklist-nouveau.conf with `blacklist nouveau` and `options nouveau modeset=0`, then `update-initramfs -u` (or `dracut --force`). `phq-agent install` does this.")
    };
    f.evidence("blacklisted_in", &cfg.blacklisted_in)
        .evidence("modeset_off_in", &cfg.modeset_off_in)
        .evidence("module_available", s.driver.nouveau_module_available)
}

fn module_loaded(s: &Snapshot) -> Finding {
    const ID: &str = "driver.module-loaded";
    let modules = match &s.driver.modules {
        Fact::Value(m) => m,
        Fact::Error(e) => return Finding::unknown(ID, format!("cannot list loaded modules: {e}")),
    };
    let nvidia: Vec<&str> = modules.iter().filter(|m| m.starts_with("nvidia")).map(String::as_str).collect();
    if nvidia.contains(&"nvidia") {
        let version = module_version(s).unwrap_or_else(|| "version unknown".into());
        return Finding::pass(ID, format!("nvidia {version} is loaded"))
            .detail(if nvidia.contains(&"nvidia_uvm") {
                String::new()
            } else {
                "nvidia_uvm is not loaded yet; CUDA loads it on first use through nvidia-modprobe.".into()
            })
            .evidence("modules", nvidia);
    }
    if s.gpus().is_empty() {
        return Finding::pass(ID, "not loaded; no NVIDIA GPU to drive");
    }
    let libs: Vec<String> = s.driver.user_libraries.iter().map(|l| format!("{} {}", l.name, l.version)).collect();
    let f = Finding::fail(ID, "the nvidia kernel module is not loaded");
    let f = if libs.is_empty() {
        f.detail("No NVIDIA user-space library is installed either: the driver is not installed.")
            .remedy("Run `phq-agent install`.")
    } else {
        f.detail(format!("The driver's libraries are installed ({}), so the module failed to build or to load: a DKMS build for this kernel that failed (missing headers), Secure Boot refusing an unsigned module, or nouveau holding the GPU.", libs.join(", ")))
            .remedy("Run `modprobe nvidia` and read the error and `dmesg | grep -i nvidia`; `dkms status` shows whether the module was built for this kernel. `phq-agent install` repairs a half-installed driver.")
    };
    f.evidence("user_libraries", libs)
}

fn open_kernel_module(s: &Snapshot) -> Finding {
    const ID: &str = "driver.open-kernel-module";
    match s.driver.nvrm.value() {
        Some(v) if v.open => Finding::pass(ID, format!("open kernel module {}", v.version)).evidence("nvrm", &v.first_line),
        Some(v) => Finding::warn(ID, format!("proprietary kernel module {}", v.version))
            .detail("NVIDIA recommends the open kernel modules for Hopper; they are the default from the 560 branch on, and features such as confidential computing and HMM need them.")
            .remedy(format!("Switch to the open flavour of the same branch: `nvidia-dkms-{b}-open` from NVIDIA's repository (or Ubuntu's `nvidia-driver-{b}-server-open`) on Ubuntu, `nvidia-kernel-open-dkms` on Debian, `dnf module switch-to nvidia-driver:{b}-open --allowerasing` on RHEL and its rebuilds; then reboot. `phq-agent install --driver-branch {b} --replace-driver` does this.", b = facts::driver_branch(&v.version).unwrap_or(facts::DEFAULT_DRIVER_BRANCH)))
            .evidence("nvrm", &v.first_line),
        None => without_module(s, ID),
    }
}

fn version_consistent(s: &Snapshot) -> Finding {
    const ID: &str = "driver.version-consistent";
    let Some(kernel) = module_version(s) else { return without_module(s, ID) };
    let mut mismatched: Vec<String> = Vec::new();
    if let (Some(proc_v), Some(sys_v)) = (s.driver.nvrm.value(), &s.driver.module_version) {
        if &proc_v.version != sys_v {
            mismatched.push(format!("/sys/module/nvidia/version {sys_v}"));
        }
    }
    for lib in &s.driver.user_libraries {
        if lib.version != kernel {
            mismatched.push(format!("{} {}", lib.path, lib.version));
        }
    }
    let nvml_version = s.nvml().and_then(|n| n.driver_version.value().cloned());
    if let Some(v) = nvml_version.as_ref().filter(|v| **v != kernel) {
        mismatched.push(format!("NVML's driver version {v}"));
    }
    let libs: Vec<String> = s.driver.user_libraries.iter().map(|l| format!("{} {}", l.name, l.version)).collect();
    let f = if !mismatched.is_empty() {
        Finding::fail(ID, format!("kernel module {kernel} does not match the installed libraries"))
            .detail(format!("Mismatched: {}. A driver upgrade was installed without a reboot (or two driver versions are installed side by side); NVML fails with \"Driver/library version mismatch\" and CUDA with error 803.", mismatched.join(", ")))
            .remedy("Reboot the VM to load the installed module (or, with no GPU process running: `rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`). If it persists, remove the stray version, reinstall one, and hold it (`apt-mark hold` / `dnf versionlock`).")
    } else if libs.is_empty() {
        Finding::pass(ID, format!("kernel module {kernel}; no versioned user-space library found to compare"))
            .detail("Looked in /usr/lib/x86_64-linux-gnu, /lib/x86_64-linux-gnu, /usr/lib64 and /usr/lib. nvml.init compares through NVML as well.")
    } else {
        Finding::pass(ID, format!("kernel module and libraries are all {kernel}"))
    };
    f.evidence("kernel_module", &kernel).evidence("user_libraries", libs).evidence("nvml_driver_version", nvml_version)
}

fn branch_supported(s: &Snapshot, settings: &Settings) -> Finding {
    const ID: &str = "driver.branch-supported";
    let version = module_version(s).or_else(|| s.driver.user_libraries.first().map(|l| l.version.clone()));
    let Some(version) = version else { return without_module(s, ID) };
    let Some(branch) = facts::driver_branch(&version) else {
        return Finding::unknown(ID, format!("cannot read a branch from driver version {version:?}"));
    };
    let target_min = facts::cuda_min_driver(&settings.cuda);
    let f = if branch < MIN_DRIVER_BRANCH {
        Finding::fail(ID, format!("driver branch {branch} is too old for Hopper and CUDA 12"))
            .detail(format!("CUDA 12 needs at least the {MIN_DRIVER_BRANCH} branch (525.60.13 for 12.0)."))
            .remedy(format!(
                "Install a current branch: `phq-agent install --driver-branch {}`.",
                settings_branch_hint(settings)
            ))
    } else {
        // NVIDIA's support matrix: a branch it does not list, or one past its end of life,
        // gets no more fixes, security ones included. That outranks a toolkit's minimum.
        let month = s.observed_at.to_string().get(..7).unwrap_or_default().to_string();
        let life = facts::branch_life(branch);
        let move_on = format!(
            "Move to a supported branch: `phq-agent install --driver-branch {} --replace-driver`.",
            facts::DEFAULT_DRIVER_BRANCH
        );
        match (life, target_min.filter(|min| facts::version_cmp(&version, min).is_lt())) {
            (Some(l), _) if l.end_of_life < month.as_str() => {
                Finding::warn(ID, format!("driver branch {branch} reached its end of life in {}", l.end_of_life))
                    .detail(format!("R{branch} was a {}; NVIDIA no longer fixes it, security issues included.", l.kind))
                    .remedy(move_on)
            }
            (None, _) => Finding::warn(ID, format!("driver branch {branch} is not in NVIDIA's support matrix: end of life"))
                .detail(format!(
                    "NVIDIA supports only the branches it lists ({}); every other one gets no fixes, security issues included.",
                    facts::DRIVER_BRANCHES.iter().map(|b| format!("R{}", b.branch)).collect::<Vec<_>>().join(", ")
                ))
                .remedy(move_on),
            (Some(_), Some(min)) => Finding::warn(ID, format!("driver {version} is older than CUDA {}'s minimum {min}", settings.cuda))
                .detail("Applications built with that toolkit still run through minor-version compatibility, but PTX JIT compilation and newer features fail.")
                .remedy(format!("Upgrade the driver to {min} or later (`phq-agent install`), or install `cuda-compat-{}` for forward compatibility.", settings.cuda.replace('.', "-"))),
            (Some(l), None) => Finding::pass(ID, format!("branch {branch} ({}, supported until {}) runs Hopper and CUDA {}", l.kind, l.end_of_life, settings.cuda)),
        }
    };
    f.evidence("version", &version).evidence("cuda_target", &settings.cuda).evidence("cuda_min_driver", target_min)
}

/// The kernel's taint flags (the kernel's "Tainted kernels" admin guide names each bit). An
/// out-of-tree module (O, 12) and an unsigned one (E, 13) are what a DKMS-built NVIDIA driver
/// sets, and a proprietary licence (P, 0) the proprietary flavour: expected. A machine check
/// (M, 4) or bad page (B, 5) is the hardware reporting errors; a kernel that died (D, 7) or
/// locked up (L, 14) since boot has had an oops or a hang, often in a driver: failures. A
/// kernel warning (W, 9) is worth a look.
fn kernel_taint(s: &Snapshot) -> Finding {
    const ID: &str = "driver.kernel-taint";
    let Some(t) = s.driver.tainted else {
        return Finding::unknown(ID, "cannot read /proc/sys/kernel/tainted");
    };
    const FLAGS: &[(u32, char, &str)] = &[
        (0, 'P', "a proprietary module is loaded"),
        (1, 'F', "a module was force-loaded"),
        (3, 'R', "a module was force-unloaded"),
        (4, 'M', "the CPU reported a machine check"),
        (5, 'B', "a bad page was found"),
        (7, 'D', "the kernel died (an oops or BUG)"),
        (9, 'W', "the kernel issued a warning"),
        (12, 'O', "an out-of-tree module is loaded"),
        (13, 'E', "an unsigned module is loaded"),
        (14, 'L', "a soft lockup occurred"),
    ];
    let set: Vec<&(u32, char, &str)> = FLAGS.iter().filter(|(bit, _, _)| t & (1 << bit) != 0).collect();
    let letters: String = set.iter().map(|(_, c, _)| *c).collect();
    let said = |bits: &[u32]| -> Vec<String> {
        set.iter().filter(|(b, _, _)| bits.contains(b)).map(|(_, c, what)| format!("{c}: {what}")).collect()
    };
    let bad = said(&[4, 5, 7, 14]);
    let warned = said(&[9]);
    let f = if !bad.is_empty() {
        Finding::fail(ID, format!("the kernel is tainted since boot: {}", bad.join("; ")))
            .detail("After an oops, lockup or hardware error the GPU driver's state cannot be trusted; the cause is in the kernel log.")
            .remedy("Read `journalctl -k -b | grep -iE 'BUG|Oops|Machine check|soft lockup|NVRM'`; restart the VM; report it to the platform if it repeats.")
    } else if !warned.is_empty() {
        Finding::warn(ID, "the kernel issued a warning since boot (taint W)")
            .remedy("Read `journalctl -k -b | grep -B2 -A20 'WARNING:'` to see which code warned.")
    } else if t == 0 {
        Finding::pass(ID, "the kernel is not tainted")
    } else {
        Finding::pass(ID, format!("tainted {letters} only by how drivers are built: {}", said(&[0, 12, 13]).join("; ")))
    };
    f.evidence("tainted", t).evidence("flags", letters)
}

/// The kernel that boots next (the newest in /boot, GRUB's default: its `10_linux` script lists
/// kernels newest first with `version_sort -r` and `GRUB_DEFAULT=0` picks the first) must have
/// the driver's module, or the next reboot — an unattended kernel upgrade's, say — brings the VM
/// up without its GPUs.
fn next_kernel(s: &Snapshot) -> Finding {
    const ID: &str = "driver.next-kernel";
    if s.gpus().is_empty() {
        return Finding::pass(ID, "no NVIDIA GPU: nothing to check");
    }
    let kernels = match &s.driver.installed_kernels {
        Fact::Value(k) => k,
        Fact::Error(e) => return Finding::unknown(ID, format!("cannot list the kernels in /boot: {e}")),
    };
    let running = s.host.kernel_release.value().cloned().unwrap_or_default();
    let Some(next) = kernels.iter().max_by_key(|k| crate::collect::driver::release_numbers(&k.release)) else {
        return Finding::unknown(ID, "no kernel image in /boot: which kernel boots next is unknown");
    };
    let f = if next.release == running {
        Finding::pass(ID, format!("the running kernel {running} is the newest installed"))
    } else if next.nvidia_module {
        Finding::pass(ID, format!("kernel {}, which boots next, has an nvidia module", next.release))
    } else {
        Finding::warn(ID, format!("kernel {} boots next but has no nvidia module", next.release))
            .detail(format!("It is newer than the running {running}; after the next reboot the VM would start without its GPU driver."))
            .remedy(format!("Build the module for it before rebooting: `apt-get install linux-headers-{0}` (or `dnf install kernel-devel-{0}`), then `dkms autoinstall -k {0}`; or hold the kernel while the driver is built for the running one.", next.release))
    };
    f.evidence("running", &running).evidence("next", &next.release)
}

fn settings_branch_hint(settings: &Settings) -> String {
    facts::cuda_min_driver(&settings.cuda)
        .and_then(facts::driver_branch)
        .unwrap_or(facts::DEFAULT_DRIVER_BRANCH)
        .max(facts::DEFAULT_DRIVER_BRANCH)
        .to_string()
}

fn device_nodes(s: &Snapshot) -> Finding {
    const ID: &str = "driver.device-nodes";
    if nvidia_loaded(s) != Some(true) {
        return without_module(s, ID);
    }
    let nodes = &s.driver.device_nodes;
    let bound = s.gpus().iter().filter(|g| g.driver.as_deref() == Some("nvidia")).count();
    let mut missing: Vec<String> = Vec::new();
    if !nodes.iter().any(|n| n == "nvidiactl") {
        missing.push("/dev/nvidiactl".into());
    }
    // Minor numbers follow probe order, not PCI order, but there is one per bound GPU.
    let per_gpu = nodes
        .iter()
        .filter(|n| n.strip_prefix("nvidia").is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit())))
        .count();
    if per_gpu < bound {
        missing.push(format!("{} of the {bound} /dev/nvidiaN nodes", bound - per_gpu));
    }
    let f = if missing.is_empty() {
        Finding::pass(ID, format!("/dev/nvidiactl and {per_gpu} GPU node(s) present")).detail(
            if nodes.iter().any(|n| n == "nvidia-uvm") {
                ""
            } else {
                "/dev/nvidia-uvm appears on first CUDA use (nvidia-modprobe creates it)."
            },
        )
    } else {
        Finding::fail(ID, format!("missing {}", missing.join(" and ")))
            .detail("CUDA and NVML open these nodes; without them every GPU call fails although the driver is loaded.")
            .remedy("Create them with `nvidia-modprobe -c 0 -u` (once per GPU index), or enable nvidia-persistenced, which creates them at boot; inside a container, pass the device nodes in.")
    };
    f.evidence("nodes", nodes).evidence("gpus_bound_to_nvidia", bound)
}

fn cuda_toolkit(s: &Snapshot, settings: &Settings) -> Finding {
    const ID: &str = "cuda.toolkit";
    let toolkits = match &s.cuda_toolkits {
        Fact::Value(t) => t,
        Fact::Error(e) => return Finding::unknown(ID, format!("cannot look for CUDA toolkits: {e}")),
    };
    let versions: Vec<String> =
        toolkits.iter().filter_map(|t| t.version.value().map(|v| format!("{} ({})", v, t.path))).collect();
    // CUDA 12 or newer: a CUDA 13 toolkit runs Hopper as well (its driver floor is
    // cuda.toolkit-driver-compatible's to judge); the H200 machine of docs/hardware-validation.md
    // had CUDA 13.0 alone and was told to install CUDA 12.
    let twelve = toolkits
        .iter()
        .filter_map(|t| t.version.value())
        .any(|v| v.split('.').next().and_then(|m| m.parse::<u32>().ok()).is_some_and(|m| m >= 12));
    let f = if twelve {
        Finding::pass(ID, format!("CUDA toolkit {}", versions.join(", ")))
    } else if s.gpus().is_empty() {
        Finding::pass(ID, "no CUDA toolkit; no NVIDIA GPU either")
    } else {
        let found = if versions.is_empty() {
            "No CUDA toolkit in /usr/local/cuda*".to_string()
        } else {
            format!("Only {} found", versions.join(", "))
        };
        Finding::warn(ID, "no CUDA 12 (or newer) toolkit installed")
            .detail(format!("{found}. Frameworks that bundle their own CUDA runtime (PyTorch wheels, containers) do not need one; building CUDA code does."))
            .remedy(format!("`phq-agent install` installs cuda-toolkit-{} from NVIDIA's repository.", settings.cuda.replace('.', "-")))
    };
    f.evidence("toolkits", versions)
}

fn toolkit_driver_compatible(s: &Snapshot) -> Finding {
    const ID: &str = "cuda.toolkit-driver-compatible";
    let toolkits: Vec<&str> =
        s.cuda_toolkits.value().into_iter().flatten().filter_map(|t| t.version.value().map(String::as_str)).collect();
    if toolkits.is_empty() {
        return Finding::pass(ID, "no CUDA toolkit installed: nothing to compare");
    }
    let Some(driver) = module_version(s) else { return without_module(s, ID) };
    let mut too_new = Vec::new();
    let mut unknown = Vec::new();
    for t in &toolkits {
        match facts::cuda_min_driver(t) {
            Some(min) if facts::version_cmp(&driver, min).is_lt() => too_new.push(format!("CUDA {t} needs ≥ {min}")),
            Some(_) => {}
            None => unknown.push(t.to_string()),
        }
    }
    let f = if !too_new.is_empty() {
        let major_gap =
            toolkits.iter().any(|t| !t.starts_with("12.")) && facts::driver_branch(&driver).is_some_and(|b| b < 580);
        let f = if major_gap {
            Finding::fail(ID, format!("driver {driver} is too old for the installed toolkit"))
        } else {
            Finding::warn(ID, format!("driver {driver} is older than the installed toolkit expects"))
        };
        f.detail(format!("{}. Within CUDA 12, minor-version compatibility runs most applications, but PTX JIT and new APIs fail; across major versions nothing runs.", too_new.join("; ")))
            .remedy("Upgrade the driver (`phq-agent install`), or install the matching `cuda-compat-12-x` package for forward compatibility.")
    } else if !unknown.is_empty() {
        Finding::pass(ID, format!("driver {driver}; toolkit {} is not in the agent's driver table", unknown.join(", ")))
    } else {
        Finding::pass(ID, format!("driver {driver} is new enough for CUDA {}", toolkits.join(", ")))
    };
    f.evidence("driver", driver).evidence("toolkits", toolkits)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    fn findings(s: &Snapshot) -> Vec<Finding> {
        let mut out = Vec::new();
        run(s, &Settings::default(), &mut out);
        out
    }

    fn sev(s: &Snapshot, id: &str) -> Severity {
        find(&findings(s), id)[0].severity
    }

    #[test]
    fn healthy_passes() {
        assert!(findings(&healthy()).iter().all(|f| f.severity == Severity::Pass), "{:#?}", findings(&healthy()));
    }

    #[test]
    fn nouveau_loaded_fails() {
        let mut s = healthy();
        s.driver.modules = Fact::Value(vec!["nouveau".into()]);
        assert_eq!(sev(&s, "driver.nouveau-disabled"), Severity::Fail);
    }

    #[test]
    fn nouveau_not_blacklisted_without_nvidia_warns() {
        let mut s = healthy();
        s.driver.modules = Fact::Value(vec![]);
        s.driver.nouveau.blacklisted_in.clear();
        assert_eq!(sev(&s, "driver.nouveau-disabled"), Severity::Warn);
        s.driver.nouveau_module_available = Some(false);
        assert_eq!(sev(&s, "driver.nouveau-disabled"), Severity::Pass);
    }

    #[test]
    fn library_mismatch_fails_and_says_reboot() {
        let mut s = healthy();
        s.driver.user_libraries[0].version = "550.127.05".into();
        let f = findings(&s);
        let v = find(&f, "driver.version-consistent")[0];
        assert_eq!(v.severity, Severity::Fail);
        assert!(v.remedy.as_ref().unwrap().starts_with("Reboot"));
    }

    #[test]
    fn a_newer_kernel_without_the_module_is_warned_about() {
        let with = |kernels: &[(&str, bool)]| {
            let mut s = healthy();
            s.driver.installed_kernels = Fact::Value(
                kernels.iter().map(|(r, m)| InstalledKernel { release: r.to_string(), nvidia_module: *m }).collect(),
            );
            find(&findings(&s), "driver.next-kernel")[0].clone()
        };
        let running = "5.15.0-113-generic";
        assert_eq!(with(&[(running, true)]).severity, Severity::Pass);
        // 5.15.0-99 is older than the running kernel, despite sorting after it as text.
        assert_eq!(with(&[(running, true), ("5.15.0-99-generic", false)]).severity, Severity::Pass);
        let f = with(&[(running, true), ("5.15.0-126-generic", false)]);
        assert_eq!(
            (f.severity, f.summary.as_str()),
            (Severity::Warn, "kernel 5.15.0-126-generic boots next but has no nvidia module")
        );
        assert_eq!(with(&[(running, true), ("5.15.0-126-generic", true)]).severity, Severity::Pass);
    }

    #[test]
    fn kernel_taint_tells_build_flags_from_trouble() {
        let at = |t: u64| {
            let mut s = healthy();
            s.driver.tainted = Some(t);
            find(&findings(&s), "driver.kernel-taint")[0].clone()
        };
        let f = at(0x3000);
        assert_eq!(f.severity, Severity::Pass);
        assert!(f.summary.contains("tainted OE only by how drivers are built"), "{}", f.summary);
        let f = at(0x3000 | 0x80);
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.summary.contains("D: the kernel died (an oops or BUG)"), "{}", f.summary);
        assert_eq!(at(0x200).severity, Severity::Warn);
        assert_eq!(at(0).summary, "the kernel is not tainted");
        let mut s = healthy();
        s.driver.tainted = None;
        assert_eq!(find(&findings(&s), "driver.kernel-taint")[0].severity, Severity::Unknown);
    }

    /// NVIDIA's support matrix in December 2026: R580 is supported, R535 ended in June 2026,
    /// R550 is no longer listed at all.
    #[test]
    fn a_branch_past_its_end_of_life_is_a_warning() {
        let at = |version: &str, when: &str| {
            let mut s = healthy();
            s.driver.nvrm = Fact::Value(NvrmVersion { version: version.into(), open: true, first_line: String::new() });
            s.driver.module_version = Some(version.into());
            s.observed_at = crate::snapshot::Timestamp(humantime::parse_rfc3339(when).unwrap());
            find(&findings(&s), "driver.branch-supported")[0].clone()
        };
        let f = at("580.82.07", "2026-12-01T00:00:00Z");
        assert_eq!(f.severity, Severity::Pass, "{f:?}");
        assert!(f.summary.contains("long-term support branch, supported until 2028-06"), "{}", f.summary);
        let f = at("535.274.02", "2026-12-01T00:00:00Z");
        assert_eq!(
            (f.severity, f.summary.as_str()),
            (Severity::Warn, "driver branch 535 reached its end of life in 2026-06")
        );
        // Before June 2026 R535 was supported; what it lacked then was CUDA 12.4's minimum.
        assert!(at("535.274.02", "2026-05-01T00:00:00Z").summary.contains("older than CUDA 12.4's minimum"));
        let f = at("550.90.07", "2026-12-01T00:00:00Z");
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.summary.contains("not in NVIDIA's support matrix"), "{}", f.summary);
        assert!(f.remedy.unwrap().contains("--driver-branch 580"));
    }

    #[test]
    fn half_installed_driver_is_explained() {
        let mut s = healthy();
        s.driver.modules = Fact::Value(vec![]);
        s.driver.nvrm = Fact::Error("not loaded".into());
        s.driver.module_version = None;
        let f = findings(&s);
        let m = find(&f, "driver.module-loaded")[0];
        assert_eq!(m.severity, Severity::Fail);
        assert!(m.detail.contains("libnvidia-ml.so 580.82.07"));
        assert_eq!(find(&f, "driver.open-kernel-module")[0].severity, Severity::Unknown);
        assert_eq!(find(&f, "driver.device-nodes")[0].severity, Severity::Unknown);
    }

    #[test]
    fn proprietary_and_old_branches() {
        let mut s = healthy();
        s.driver.nvrm =
            Fact::Value(NvrmVersion { version: "535.129.03".into(), open: false, first_line: String::new() });
        s.driver.module_version = Some("535.129.03".into());
        s.driver.user_libraries.clear();
        assert_eq!(sev(&s, "driver.open-kernel-module"), Severity::Warn);
        assert_eq!(sev(&s, "driver.branch-supported"), Severity::Warn);
        assert_eq!(sev(&s, "cuda.toolkit-driver-compatible"), Severity::Warn);
        s.driver.nvrm =
            Fact::Value(NvrmVersion { version: "515.65.01".into(), open: false, first_line: String::new() });
        s.driver.module_version = None;
        assert_eq!(sev(&s, "driver.branch-supported"), Severity::Fail);
    }

    #[test]
    fn missing_device_nodes_fail() {
        let mut s = healthy();
        s.driver.device_nodes.retain(|n| n != "nvidia7" && n != "nvidiactl");
        let f = findings(&s);
        let d = find(&f, "driver.device-nodes")[0];
        assert_eq!(d.severity, Severity::Fail);
        assert!(d.summary.contains("/dev/nvidiactl") && d.summary.contains("1 of the 8"), "{}", d.summary);
    }

    #[test]
    fn no_toolkit_warns() {
        let mut s = healthy();
        s.cuda_toolkits = Fact::Value(vec![]);
        assert_eq!(sev(&s, "cuda.toolkit"), Severity::Warn);
        assert_eq!(sev(&s, "cuda.toolkit-driver-compatible"), Severity::Pass);
    }

    /// The H200 machine of 2026-12-04: CUDA 13.0 alone, driver 580. A toolkit newer than 12 is
    /// a toolkit; an 11 is not enough.
    #[test]
    fn a_cuda_13_toolkit_alone_passes_and_11_alone_warns() {
        let mut s = healthy();
        let only = |v: &str| {
            Fact::Value(vec![CudaToolkit { path: format!("/usr/local/cuda-{v}"), version: Fact::Value(v.into()) }])
        };
        s.cuda_toolkits = only("13.0");
        assert_eq!(sev(&s, "cuda.toolkit"), Severity::Pass);
        s.cuda_toolkits = only("11.8");
        assert_eq!(sev(&s, "cuda.toolkit"), Severity::Warn);
    }
}
