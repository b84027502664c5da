//! The NVIDIA kernel driver as the guest sees it without NVML: loaded modules, the version the
//! kernel module reports, the nouveau blacklist, `/dev/nvidia*`, and the versions of the
//! user-space libraries installed (whose file names carry the driver version).

use crate::snapshot::{Driver, Fact, NouveauConfig, NvrmVersion, UserLibrary};
use crate::sysroot::Sysroot;

/// modprobe.d(5) search order.
const MODPROBE_DIRS: &[&str] =
    &["etc/modprobe.d", "run/modprobe.d", "usr/local/lib/modprobe.d", "usr/lib/modprobe.d", "lib/modprobe.d"];

/// Where distributions put the driver's user-space libraries (Debian/Ubuntu multiarch, RHEL).
const LIBRARY_DIRS: &[&str] = &["usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "usr/lib"];

/// Libraries whose version must match the kernel module's exactly.
const VERSIONED_LIBRARIES: &[&str] = &["libnvidia-ml.so", "libcuda.so"];

pub fn read(root: &Sysroot, kernel_release: Option<&str>, cmdline: Option<&str>) -> Driver {
    let modules: Fact<Vec<String>> = match root.read_string("proc/modules") {
        Ok(t) => Fact::Value(parse_proc_modules(&t)),
        // A kernel built without loadable-module support has no /proc/modules: nothing is loaded.
        Err(e) if e.is_not_found() => Fact::Value(Vec::new()),
        Err(e) => Fact::Error(e.to_string()),
    };
    let nvrm = match root.read_string("proc/driver/nvidia/version") {
        Ok(text) => parse_nvrm_version(&text).map(Fact::Value).unwrap_or_else(|| {
            Fact::Error(format!("/proc/driver/nvidia/version: no version in {:?}", text.lines().next().unwrap_or("")))
        }),
        Err(e) if e.is_not_found() => {
            Fact::Error("/proc/driver/nvidia/version does not exist: the nvidia kernel module is not loaded".into())
        }
        Err(e) => Fact::Error(e.to_string()),
    };
    let mut nouveau = read_modprobe_config(root);
    if let Some(cmdline) = cmdline {
        let (blacklisted, modeset_off) = parse_cmdline_nouveau(cmdline);
        if blacklisted {
            nouveau.blacklisted_in.push("kernel command line".into());
        }
        if modeset_off {
            nouveau.modeset_off_in.push("kernel command line".into());
        }
    }
    Driver {
        modules,
        nvrm,
        module_version: root.read_attr("sys/module/nvidia/version").ok().filter(|v| !v.is_empty()),
        nouveau,
        nouveau_module_available: kernel_release.and_then(|r| nouveau_module_available(root, r)),
        device_nodes: root
            .list_dir("dev")
            .map(|names| names.into_iter().filter(|n| n.starts_with("nvidia")).collect())
            .unwrap_or_default(),
        user_libraries: read_user_libraries(root),
        tainted: root.read_attr("proc/sys/kernel/tainted").ok().and_then(|t| t.trim().parse().ok()),
        installed_kernels: installed_kernels(root),
        fabric_manager_binary: root.exists(FABRIC_MANAGER_BINARY),
    }
}

/// Where the fabric manager's program lives: the packaged unit starts
/// `/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg` (as
/// `systemctl status nvidia-fabricmanager` shows on HGX hosts).
pub const FABRIC_MANAGER_BINARY: &str = "usr/bin/nv-fabricmanager";

/// Every `vmlinuz-<release>` in /boot, each with whether an `nvidia.ko` (plain or compressed) is
/// somewhere under /lib/modules/<release> (DKMS puts it in updates/dkms, distributions' builds
/// elsewhere).
fn installed_kernels(root: &Sysroot) -> Fact<Vec<crate::snapshot::InstalledKernel>> {
    let names = match root.list_dir("boot") {
        Ok(n) => n,
        Err(e) => return Fact::Error(e.to_string()),
    };
    let mut kernels: Vec<crate::snapshot::InstalledKernel> = names
        .iter()
        .filter_map(|n| n.strip_prefix("vmlinuz-"))
        .map(|release| crate::snapshot::InstalledKernel {
            release: release.to_string(),
            nvidia_module: has_nvidia_module(root, &format!("lib/modules/{release}"), 0),
        })
        .collect();
    kernels.sort_by_key(|k| release_numbers(&k.release));
    Fact::Value(kernels)
}

fn has_nvidia_module(root: &Sysroot, dir: &str, depth: u32) -> bool {
    const MODULE: [&str; 4] = ["nvidia.ko", "nvidia.ko.xz", "nvidia.ko.zst", "nvidia.ko.gz"];
    let Ok(names) = root.list_dir(dir) else { return false };
    if names.iter().any(|n| MODULE.contains(&n.as_str())) {
        return true;
    }
    // Modules sit at most a few directories down (kernel/drivers/video/…, updates/dkms).
    depth < 5
        && names
            .iter()
            .filter(|n| !n.contains('.') || n.ends_with(".d"))
            .any(|n| has_nvidia_module(root, &format!("{dir}/{n}"), depth + 1))
}

/// `6.1.0-27-cloud-amd64` → [6, 1, 0, 27, 64]: the numbers of a release, for ordering kernels
/// as GRUB's newest-first default does.
pub fn release_numbers(release: &str) -> Vec<u64> {
    release.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect()
}

/// Module names from /proc/modules (`nvidia 56799232 2 nvidia_uvm,nvidia_modeset, Live 0x0 (POE)`).
pub fn parse_proc_modules(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect()
}

/// First line of /proc/driver/nvidia/version:
/// `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.90.07  Release Build  (…)  Fri May 31 …`
/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023`
pub fn parse_nvrm_version(text: &str) -> Option<NvrmVersion> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    let version = line.split_whitespace().find(|w| looks_like_driver_version(w))?;
    Some(NvrmVersion {
        version: version.to_string(),
        open: line.contains("Open Kernel Module"),
        first_line: line.trim().to_string(),
    })
}

/// `550.90.07`, `570.26`: digits and dots, at least one dot, a branch of three digits.
pub fn looks_like_driver_version(w: &str) -> bool {
    let mut parts = w.split('.');
    let Some(branch) = parts.next() else { return false };
    let rest: Vec<&str> = parts.collect();
    branch.len() == 3
        && branch.bytes().all(|b| b.is_ascii_digit())
        && !rest.is_empty()
        && rest.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

fn read_modprobe_config(root: &Sysroot) -> NouveauConfig {
    let mut cfg = NouveauConfig::default();
    for dir in MODPROBE_DIRS {
        let Ok(names) = root.list_dir(dir) else { continue };
        for name in names.iter().filter(|n| n.ends_with(".conf")) {
            let rel = format!("{dir}/{name}");
            match root.read_string(&rel) {
                Ok(text) => {
                    let (blacklisted, modeset_off) = parse_modprobe_nouveau(&text);
                    if blacklisted {
                        cfg.blacklisted_in.push(Sysroot::display(&rel));
                    }
                    if modeset_off {
                        cfg.modeset_off_in.push(Sysroot::display(&rel));
                    }
                }
                Err(e) => cfg.unreadable.push(e.to_string()),
            }
        }
    }
    cfg
}

/// Whether a modprobe.d file blacklists nouveau, and whether it sets `modeset=0` for it.
/// `install nouveau /bin/false` (and `/bin/true`) also keeps it from loading.
pub fn parse_modprobe_nouveau(text: &str) -> (bool, bool) {
    let mut blacklisted = false;
    let mut modeset_off = false;
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["blacklist", "nouveau", ..] => blacklisted = true,
            ["install", "nouveau", cmd, ..] if cmd.ends_with("/false") || cmd.ends_with("/true") => blacklisted = true,
            ["options", "nouveau", opts @ ..] if opts.contains(&"modeset=0") => modeset_off = true,
            _ => {}
        }
    }
    (blacklisted, modeset_off)
}

/// `modprobe.blacklist=nouveau,…`, `rd.driver.blacklist=nouveau`, `nouveau.modeset=0`.
pub fn parse_cmdline_nouveau(cmdline: &str) -> (bool, bool) {
    let mut blacklisted = false;
    let mut modeset_off = false;
    for arg in cmdline.split_whitespace() {
        let Some((key, value)) = arg.split_once('=') else { continue };
        match key {
            "modprobe.blacklist" | "rd.driver.blacklist" | "module_blacklist"
                if value.split(',').any(|m| m == "nouveau") =>
            {
                blacklisted = true
            }
            "nouveau.modeset" if value == "0" => modeset_off = true,
            _ => {}
        }
    }
    (blacklisted, modeset_off)
}

fn nouveau_module_available(root: &Sysroot, release: &str) -> Option<bool> {
    let base = format!("lib/modules/{release}");
    if root.exists(&format!("{base}/kernel/drivers/gpu/drm/nouveau")) {
        return Some(true);
    }
    // `modules.builtin` lists built-in drivers; without the module tree we cannot say.
    if let Ok(builtin) = root.read_string(&format!("{base}/modules.builtin")) {
        if builtin.lines().any(|l| l.ends_with("/nouveau.ko")) {
            return Some(true);
        }
    }
    root.exists(&format!("{base}/kernel")).then_some(false)
}

fn read_user_libraries(root: &Sysroot) -> Vec<UserLibrary> {
    let mut found = Vec::new();
    for dir in LIBRARY_DIRS {
        let Ok(names) = root.list_dir(dir) else { continue };
        for name in names {
            if let Some((lib, version)) = parse_library_name(&name) {
                found.push(UserLibrary {
                    name: lib.to_string(),
                    version,
                    path: Sysroot::display(&format!("{dir}/{name}")),
                });
            }
        }
    }
    found
}

/// `libnvidia-ml.so.550.90.07` → (`libnvidia-ml.so`, `550.90.07`); `libcuda.so.1` is a link
/// with no version in its name and is skipped.
pub fn parse_library_name(name: &str) -> Option<(&'static str, String)> {
    VERSIONED_LIBRARIES.iter().find_map(|lib| {
        let version = name.strip_prefix(lib)?.strip_prefix('.')?;
        looks_like_driver_version(version).then(|| (*lib, version.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn open_module_version_line() {
        let text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.90.07  Release Build  (dvs-builder@U16-I3-B03-4-3)  Fri May 31 09:38:15 UTC 2024\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n";
        let v = parse_nvrm_version(text).unwrap();
        assert_eq!(v.version, "550.90.07");
        assert!(v.open);
    }

    #[test]
    fn proprietary_module_version_line() {
        let text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n";
        let v = parse_nvrm_version(text).unwrap();
        assert_eq!(v.version, "535.129.03");
        assert!(!v.open);
    }

    #[test]
    fn proc_modules() {
        let text = "nvidia_uvm 4890624 0 - Live 0x0000000000000000 (POE)\nnvidia 56799232 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)\n";
        assert_eq!(parse_proc_modules(text), vec!["nvidia_uvm", "nvidia"]);
    }

    #[test]
    fn modprobe_files() {
        assert_eq!(parse_modprobe_nouveau("blacklist nouveau\noptions nouveau modeset=0\n"), (true, true));
        assert_eq!(parse_modprobe_nouveau("# blacklist nouveau\n"), (false, false));
        assert_eq!(parse_modprobe_nouveau("install nouveau /bin/false\n"), (true, false));
        assert_eq!(parse_modprobe_nouveau("blacklist nouveaux\n"), (false, false));
    }

    #[test]
    fn cmdline() {
        assert_eq!(parse_cmdline_nouveau("ro quiet modprobe.blacklist=floppy,nouveau nouveau.modeset=0"), (true, true));
        assert_eq!(parse_cmdline_nouveau("ro quiet"), (false, false));
    }

    #[test]
    fn library_names() {
        assert_eq!(parse_library_name("libnvidia-ml.so.550.90.07"), Some(("libnvidia-ml.so", "550.90.07".into())));
        assert_eq!(parse_library_name("libcuda.so.1"), None);
        assert_eq!(parse_library_name("libcudart.so.12.4.127"), None);
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in ".*") {
            let _ = parse_nvrm_version(&s);
            let _ = parse_proc_modules(&s);
            let _ = parse_modprobe_nouveau(&s);
            let _ = parse_cmdline_nouveau(&s);
            let _ = parse_library_name(&s);
        }

        #[test]
        fn nvrm_finds_any_wellformed_version(b in 400u32..999, m in 0u32..300, p in 0u32..100) {
            let line = format!("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {b}.{m}.{p:02}  Release Build\n");
            prop_assert_eq!(parse_nvrm_version(&line).unwrap().version, format!("{b}.{m}.{p:02}"));
        }
    }
}
