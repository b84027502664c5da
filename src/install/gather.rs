//! The facts the plan is made from, read once: the snapshot, plus the files the plan writes,
//! the keys it installs, the units enabled on disk and dnf's version locks, all through the
//! `Sysroot`. Nothing after this reads the guest to decide; `apply` reads it only to act.

use super::plan::{self, Distro, Facts};
use crate::snapshot::{Package, Snapshot};
use crate::sysroot::Sysroot;
use std::collections::BTreeMap;

/// The installer's view of a guest: the snapshot, plus the files the plan writes and the units
/// enabled on disk (a chroot or an early boot has no systemd to ask). Packages are the
/// snapshot's (dpkg's status file, or `rpm -qa` on RPM guests), with dnf's version locks read.
pub fn gather(root: &Sysroot, s: &Snapshot) -> Facts {
    let os = s.host.os.value().cloned().ok_or_else(|| s.host.os.error().unwrap_or("unreadable").to_string());
    let distro = os.as_ref().ok().and_then(|o| Distro::from_os(o).ok());
    let mut paths = vec![plan::NOUVEAU_CONF.to_string(), plan::DEBIAN_PIN_PATH.into(), plan::RHEL_REPO_PATH.into()];
    if let Some(d) = &distro {
        paths.push(d.apt_source_path());
    }
    let files: BTreeMap<String, String> =
        paths.into_iter().filter_map(|p| root.read_string(p.trim_start_matches('/')).ok().map(|c| (p, c))).collect();
    let keys: BTreeMap<String, Vec<u8>> = [plan::NVIDIA_APT_KEYRING, plan::RHEL_KEY_PATH]
        .into_iter()
        .filter_map(|p| root.read_bytes(p.trim_start_matches('/')).ok().map(|c| (p.to_string(), c)))
        .collect();
    let enabled_units = root.list_dir(plan::WANTS_DIR.trim_start_matches('/')).unwrap_or_default();
    let mut packages: Result<Vec<Package>, String> = match &s.packages {
        crate::snapshot::Fact::Value(v) => Ok(v.clone()),
        crate::snapshot::Fact::Error(e) => Err(e.clone()),
    };
    if let (Ok(ps), Ok(list)) = (&mut packages, root.read_string(plan::VERSIONLOCK_LIST.trim_start_matches('/'))) {
        for p in ps.iter_mut() {
            p.held |= versionlocked(&list, &p.name);
        }
    }
    let modules = s.driver.modules.value().cloned().unwrap_or_default();
    // apt's sources, for which components of the distribution's archive are enabled.
    let mut apt_sources: Vec<(String, String)> = Vec::new();
    if let Ok(t) = root.read_string("etc/apt/sources.list") {
        apt_sources.push(("/etc/apt/sources.list".into(), t));
    }
    let mut names = root.list_dir("etc/apt/sources.list.d").unwrap_or_default();
    names.sort();
    for n in names.into_iter().filter(|n| n.ends_with(".list") || n.ends_with(".sources")) {
        if let Ok(t) = root.read_string(&format!("etc/apt/sources.list.d/{n}")) {
            apt_sources.push((format!("/etc/apt/sources.list.d/{n}"), t));
        }
    }
    Facts {
        os,
        kernel: s.host.kernel_release.value().cloned(),
        headers_present: s.host.kernel_headers.value().is_some_and(|h| h.present),
        secure_boot: s.host.secure_boot.value().copied(),
        gpus: s.gpus().len(),
        nvswitches: s.pci.value().map(|p| p.iter().filter(|d| d.is_nvswitch()).count()).unwrap_or(0),
        packages,
        nouveau_off: !s.driver.nouveau.blacklisted_in.is_empty() && !s.driver.nouveau.modeset_off_in.is_empty(),
        nouveau_loaded: modules.iter().any(|m| m == "nouveau"),
        nvidia_loaded: modules
            .iter()
            .any(|m| m == "nvidia")
            .then(|| s.driver.nvrm.value().map(|v| v.version.clone()).or(s.driver.module_version.clone()))
            .flatten(),
        nvidia_module_built: s.host.kernel_release.value().is_some_and(|k| nvidia_module_under(root, k)),
        dpkg_interrupted: root.list_dir("var/lib/dpkg/updates").is_ok_and(|v| !v.is_empty()),
        apt_lists: root.list_dir("var/lib/apt/lists").unwrap_or_default(),
        apt_sources,
        enabled_units,
        files,
        keys,
    }
}

/// An `nvidia.ko` (or `.ko.xz`, `.ko.zst`) for `kernel` where module packages and DKMS put them:
/// `extra/` (DKMS on EL, NVIDIA's precompiled kmods), `updates/` (`updates/dkms/` on Debian and
/// Ubuntu), `weak-updates/`, and `kernel/` for a module shipped with the kernel (Ubuntu's
/// `linux-modules-nvidia-*` put theirs under `kernel/nvidia-<branch>/`). Three levels down.
fn nvidia_module_under(root: &Sysroot, kernel: &str) -> bool {
    fn walk(root: &Sysroot, dir: &str, depth: u32) -> bool {
        let Ok(names) = root.list_dir(dir) else { return false };
        names.iter().any(|n| {
            ["nvidia.ko", "nvidia.ko.xz", "nvidia.ko.zst", "nvidia.ko.gz"].contains(&n.as_str())
                || (depth > 0 && walk(root, &format!("{dir}/{n}"), depth - 1))
        })
    }
    ["extra", "updates", "weak-updates", "kernel"]
        .iter()
        .any(|d| walk(root, &format!("lib/modules/{kernel}/{d}"), if *d == "kernel" { 1 } else { 2 }))
}

/// `dnf versionlock` writes `name-epoch:version-release.*` lines.
fn versionlocked(list: &str, name: &str) -> bool {
    list.lines().map(str::trim).filter(|l| !l.starts_with('#')).any(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix('-'))
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where DKMS and the module packages put `nvidia.ko`: EL's DKMS `extra/` (compressed),
    /// Debian's `updates/dkms/`, Ubuntu's signed `kernel/nvidia-<branch>srv/`; not another kernel's.
    #[test]
    fn the_running_kernels_nvidia_module_is_found_where_dkms_puts_it() {
        let k = "5.14.0-427.13.1.el9_4.x86_64";
        for place in [
            format!("lib/modules/{k}/extra/nvidia.ko.xz"),
            format!("lib/modules/{k}/updates/dkms/nvidia.ko"),
            format!("lib/modules/{k}/kernel/nvidia-580srv/nvidia.ko"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let f = dir.path().join(&place);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(&f, b"").unwrap();
            assert!(nvidia_module_under(&Sysroot::new(dir.path()), k), "{place}");
            assert!(!nvidia_module_under(&Sysroot::new(dir.path()), "5.14.0-503.11.1.el9_5.x86_64"), "{place}");
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(format!("lib/modules/{k}/extra"))).unwrap();
        assert!(!nvidia_module_under(&Sysroot::new(dir.path()), k));
    }

    #[test]
    fn versionlock_lines() {
        let list = "# Added lock\nkmod-nvidia-open-dkms-3:550.90.07-1.el9.*\nnvidia-driver-3:550.90.07-1.el9.*\n";
        assert!(versionlocked(list, "kmod-nvidia-open-dkms"));
        assert!(versionlocked(list, "nvidia-driver"));
        assert!(!versionlocked(list, "nvidia"));
        assert!(!versionlocked(list, "cuda-toolkit-12-4"));
    }
}
