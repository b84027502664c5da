//! Installed NVIDIA and CUDA packages: the dpkg database (`/var/lib/dpkg/status`, text) on
//! Debian and Ubuntu; on RHEL-family guests the RPM database, which is binary (SQLite on EL9), so
//! `rpm` itself reads it. Where neither can be read the answer is an error, never "nothing
//! installed".

use crate::snapshot::{Fact, Package};
use crate::sysroot::Sysroot;

/// Packages worth keeping: the driver, fabric manager, NSCQ, CUDA, NCCL (`libnccl2`, `libnccl`:
/// the installer installs the build for the toolkit's CUDA and holds it), and the kernel's
/// (images, headers, Ubuntu's per-kernel NVIDIA modules and signatures, their flavour metas; EL's
/// kernel packages), which the installer holds and checks for.
fn relevant(name: &str) -> bool {
    [
        "nvidia",
        "libnvidia",
        "cuda",
        "libcuda",
        "libnccl",
        "kmod-nvidia",
        "linux-image-",
        "linux-headers-",
        "linux-modules-",
        "linux-signatures-",
    ]
    .iter()
    .any(|p| name.starts_with(p))
        || ["kernel", "kernel-core", "kernel-modules", "kernel-devel", "kernel-headers"].contains(&name)
}

pub fn read(root: &Sysroot) -> Fact<Vec<Package>> {
    // An RPM-family guest's packages are in its RPM database even where a dpkg status file lies
    // beside it (EPEL carries dpkg; the real-dnf test's EL root is built from Debian's packages).
    if rpm_family(root) && root.exists("var/lib/rpm") {
        return read_rpm(root);
    }
    match root.read_string("var/lib/dpkg/status") {
        Ok(text) => Fact::Value(parse_dpkg_status(&text)),
        Err(e) if e.is_not_found() && root.exists("var/lib/rpm") => read_rpm(root),
        // No database at all (a minimal image, a runfile install): nothing can be said to be
        // absent, so this is "cannot read", never "nothing installed".
        Err(e) if e.is_not_found() => Fact::Error(
            "no package database (neither /var/lib/dpkg/status nor /var/lib/rpm): what is installed cannot be read from packages".into(),
        ),
        Err(e) => Fact::Error(e.to_string()),
    }
}

/// os-release says RHEL or a relative (`ID` or `ID_LIKE` naming rhel, fedora or centos).
fn rpm_family(root: &Sysroot) -> bool {
    let Ok(text) = root.read_string("etc/os-release") else { return false };
    text.lines().filter_map(|l| l.strip_prefix("ID=").or_else(|| l.strip_prefix("ID_LIKE="))).any(|v| {
        v.trim_matches('"')
            .split_whitespace()
            .any(|id| ["rhel", "fedora", "centos", "rocky", "almalinux"].contains(&id))
    })
}

/// The RPM database through `rpm -qa`: on the running system with rpm's own settings; under a
/// sysroot with `--root` and `--dbpath /var/lib/rpm`, where RHEL 9 keeps it (an rpm built for
/// another distribution has another default: Debian's is `~/.rpmdb`). No `rpm` program, or one
/// that fails, is an error that says so.
fn read_rpm(root: &Sysroot) -> Fact<Vec<Package>> {
    // rpm creates an empty database where it finds none: ask only when one is there (SQLite on
    // EL9, Berkeley DB `Packages` before), so reading never writes into a sysroot.
    if !["rpmdb.sqlite", "Packages", "Packages.db"].iter().any(|f| root.exists(&format!("var/lib/rpm/{f}"))) {
        return Fact::Error(
            "RPM-based guest with no RPM database in /var/lib/rpm (rpmdb.sqlite): what is installed cannot be read"
                .into(),
        );
    }
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    if !root.is_live() {
        // rpm takes only an absolute --root.
        let abs = std::fs::canonicalize(root.root()).unwrap_or_else(|_| root.root().to_path_buf());
        args.extend(["--root".into(), abs.into_os_string(), "--dbpath".into(), "/var/lib/rpm".into()]);
    }
    args.extend(["-qa".into(), "--qf".into(), "%{NAME}\t%{VERSION}-%{RELEASE}\n".into()]);
    match std::process::Command::new("rpm").args(&args).stdin(std::process::Stdio::null()).output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Fact::Error("RPM-based guest, and no `rpm` program to read its database (/var/lib/rpm) with".into())
        }
        Err(e) => Fact::Error(format!("rpm: {e}")),
        Ok(o) if !o.status.success() => Fact::Error(format!(
            "rpm -qa could not read /var/lib/rpm (exit {}): {}",
            o.status.code().map_or("by signal".to_string(), |c| c.to_string()),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(o) => Fact::Value(parse_rpm_qa(&String::from_utf8_lossy(&o.stdout))),
    }
}

/// `rpm -qa --qf '%{NAME}\t%{VERSION}-%{RELEASE}\n'` → the NVIDIA and CUDA packages (everything
/// rpm lists is installed; a version lock shows as held once the installer reads its list).
pub fn parse_rpm_qa(text: &str) -> Vec<Package> {
    text.lines()
        .filter_map(|l| l.split_once('\t'))
        .filter(|(n, _)| relevant(n))
        .map(|(n, v)| Package {
            name: n.trim().into(),
            version: v.trim().into(),
            state: "installed".into(),
            held: false,
        })
        .collect()
}

/// dpkg's status file: stanzas of `Field: value` separated by blank lines. Only installed
/// (`install ok installed`) NVIDIA/CUDA packages are kept; half-configured ones are kept too,
/// marked, since they are what a half-finished install leaves.
pub fn parse_dpkg_status(text: &str) -> Vec<Package> {
    let mut out = Vec::new();
    for stanza in text.split("\n\n") {
        let mut name = None;
        let mut version = None;
        let mut status = None;
        for line in stanza.lines() {
            if let Some(v) = line.strip_prefix("Package: ") {
                name = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Version: ") {
                version = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Status: ") {
                status = Some(v.trim());
            }
        }
        let (Some(name), Some(version), Some(status)) = (name, version, status) else { continue };
        if !relevant(name) || status.ends_with("not-installed") || status.ends_with("config-files") {
            continue;
        }
        out.push(Package {
            name: name.into(),
            version: version.into(),
            state: status.rsplit(' ').next().unwrap_or("").into(),
            held: status.starts_with("hold "),
        });
    }
    out
}

/// `550.90.07-1` → `550.90.07` (the upstream part of a Debian version, without epoch).
pub fn upstream_version(v: &str) -> &str {
    let v = v.split_once(':').map(|(_, r)| r).unwrap_or(v);
    v.rsplit_once('-').map(|(u, _)| u).unwrap_or(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An EL guest with dpkg installed beside rpm (EPEL carries it): its packages are the RPM
    /// database's, never dpkg's status file.
    #[test]
    fn an_rpm_guest_with_a_dpkg_status_reads_rpm() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("var/lib/dpkg")).unwrap();
        std::fs::create_dir_all(dir.path().join("var/lib/rpm")).unwrap();
        std::fs::write(dir.path().join("etc/os-release"), "ID=\"rocky\"\nID_LIKE=\"rhel centos fedora\"\n").unwrap();
        std::fs::write(
            dir.path().join("var/lib/dpkg/status"),
            "Package: nvidia-driver-cuda\nStatus: install ok installed\nVersion: 580.82.07-1\n",
        )
        .unwrap();
        let root = Sysroot::new(dir.path());
        assert!(matches!(read(&root), Fact::Error(e) if e.contains("RPM database")));
        std::fs::write(dir.path().join("etc/os-release"), "ID=debian\n").unwrap();
        assert!(matches!(read(&root), Fact::Value(v) if v.len() == 1));
    }

    #[test]
    fn rpm_listing() {
        let p = parse_rpm_qa(
            "bash\t5.1.8-9.el9\nkmod-nvidia-open-dkms\t550.90.07-1.el9\ncuda-toolkit-12-4\t12.4.1-1\nbroken line\n",
        );
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].name, "kmod-nvidia-open-dkms");
        assert_eq!(upstream_version(&p[0].version), "550.90.07");
        // The kernel's packages too: the installer holds them.
        let k = parse_rpm_qa(
            "kernel\t5.14.0-427.13.1.el9_4\nkernel-core\t5.14.0-427.13.1.el9_4\nkernel-tools\t5.14.0-427.13.1.el9_4\n",
        );
        assert_eq!(k.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["kernel", "kernel-core"]);
        // NCCL, whose version says which CUDA it was built for.
        let n = parse_rpm_qa("libnccl\t2.27.3-1+cuda12.9\n");
        assert_eq!((n[0].name.as_str(), n[0].version.as_str()), ("libnccl", "2.27.3-1+cuda12.9"));
    }

    #[test]
    fn dpkg_status() {
        let text = "Package: bash\nStatus: install ok installed\nVersion: 5.2\n\nPackage: nvidia-fabricmanager-550\nStatus: install ok installed\nVersion: 550.90.07-1\n\nPackage: nvidia-driver-550-server-open\nStatus: install ok half-configured\nVersion: 550.90.07-0ubuntu0.22.04.1\n\nPackage: cuda-toolkit-12-4\nStatus: deinstall ok config-files\nVersion: 12.4.1-1\n";
        let p = parse_dpkg_status(text);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].name, "nvidia-fabricmanager-550");
        assert_eq!(upstream_version(&p[0].version), "550.90.07");
        assert_eq!(p[1].state, "half-configured");
        assert!(!p[0].held);
        assert!(parse_dpkg_status("Package: cuda-toolkit-12-4\nStatus: hold ok installed\nVersion: 1\n")[0].held);
        let nccl = parse_dpkg_status("Package: libnccl2\nStatus: hold ok installed\nVersion: 2.27.3-1+cuda12.9\n");
        assert!(nccl[0].held && nccl[0].version == "2.27.3-1+cuda12.9");
        assert_eq!(upstream_version("1:550.90.07-0ubuntu0.22.04.1"), "550.90.07");
    }

    proptest! {
        #[test]
        fn never_panics(s in ".*") {
            for p in parse_dpkg_status(&s) {
                let _ = upstream_version(&p.version);
            }
        }
    }
}
