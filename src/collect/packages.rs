//! Installed NVIDIA and CUDA packages, from the dpkg database (`/var/lib/dpkg/status`). The RPM
//! database is not a text file; on RHEL-family guests this reports that it was not read.

use crate::snapshot::{Fact, Package};
use crate::sysroot::Sysroot;

/// Packages worth keeping: the driver, fabric manager, NSCQ, CUDA.
fn relevant(name: &str) -> bool {
    ["nvidia", "libnvidia", "cuda", "libcuda"].iter().any(|p| name.starts_with(p))
}

pub fn read(root: &Sysroot) -> Fact<Vec<Package>> {
    match root.read_string("var/lib/dpkg/status") {
        Ok(text) => Fact::Value(parse_dpkg_status(&text)),
        Err(e) if e.is_not_found() && root.exists("var/lib/rpm") => {
            Fact::Error("RPM-based guest: the RPM database is not read (compare `rpm -qa 'nvidia*'` by hand)".into())
        }
        // No database at all (a minimal image, a runfile install): nothing can be said to be
        // absent, so this is "cannot read", never "nothing installed".
        Err(e) if e.is_not_found() => Fact::Error(
            "no package database (neither /var/lib/dpkg/status nor /var/lib/rpm): what is installed cannot be read from packages".into(),
        ),
        Err(e) => Fact::Error(e.to_string()),
    }
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
