//! The guest itself: distribution, kernel, DMI (KubeVirt detection, the VM's UUID),
//! kernel headers and Secure Boot. Readers take a `Sysroot`; parsers take text.

use crate::snapshot::{Dmi, Fact, Host, KernelHeaders, OsRelease, SecureBoot};
use crate::sysroot::Sysroot;

/// EFI global-variable GUID that holds `SecureBoot` (UEFI spec, EFI_GLOBAL_VARIABLE).
const SECURE_BOOT_VAR: &str = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c";

pub fn read(root: &Sysroot) -> Host {
    let kernel_release: Fact<String> = root.read_attr("proc/sys/kernel/osrelease").into();
    let kernel_headers = match kernel_release.value() {
        Some(release) => Fact::Value(read_kernel_headers(root, release)),
        None => Fact::Error("kernel release unknown, so the headers cannot be looked up".into()),
    };
    Host {
        hostname: root.read_attr("proc/sys/kernel/hostname").ok().filter(|h| !h.is_empty()),
        os: read_os_release(root),
        kernel_release,
        cmdline: root.read_attr("proc/cmdline").into(),
        boot_id: root.read_attr("proc/sys/kernel/random/boot_id").ok().filter(|b| !b.is_empty()),
        dmi: read_dmi(root),
        cpu_hypervisor_flag: root.read_string("proc/cpuinfo").ok().map(|c| cpu_has_hypervisor_flag(&c)),
        kernel_headers,
        secure_boot: read_secure_boot(root),
        vsock_cid: root.read_vsock_cid("dev/vsock").into(),
        uptime_s: root
            .read_string("proc/uptime")
            .ok()
            .and_then(|u| u.split_whitespace().next()?.parse().ok())
            .filter(|u: &f64| u.is_finite() && *u >= 0.0),
        blocked_in_driver: super::procs::blocked_in_driver(root),
    }
}

/// `/etc/os-release`, falling back to `/usr/lib/os-release` as os-release(5) says.
fn read_os_release(root: &Sysroot) -> Fact<OsRelease> {
    match root.read_string("etc/os-release") {
        Ok(text) => Fact::Value(parse_os_release(&text)),
        Err(first) => match root.read_string("usr/lib/os-release") {
            Ok(text) => Fact::Value(parse_os_release(&text)),
            Err(_) => Fact::Error(first.to_string()),
        },
    }
}

/// Parses os-release(5): `KEY=value` lines, values optionally quoted with shell escapes.
pub fn parse_os_release(text: &str) -> OsRelease {
    let mut os = OsRelease::default();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some((key, raw)) = line.split_once('=') else { continue };
        let value = unquote(raw.trim());
        match key.trim() {
            "ID" => os.id = value.to_ascii_lowercase(),
            "ID_LIKE" => os.id_like = value.split_whitespace().map(|s| s.to_ascii_lowercase()).collect(),
            "VERSION_ID" => os.version_id = value,
            "PRETTY_NAME" => os.pretty_name = value,
            _ => {}
        }
    }
    os
}

fn unquote(v: &str) -> String {
    let inner = if v.len() >= 2 && (v.starts_with('"') && v.ends_with('"') || v.starts_with('\'') && v.ends_with('\''))
    {
        &v[1..v.len() - 1]
    } else {
        v
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn read_dmi(root: &Sysroot) -> Fact<Dmi> {
    let attr = |name: &str| root.read_attr(&format!("sys/class/dmi/id/{name}")).ok().filter(|v| !v.is_empty());
    let dmi = Dmi {
        sys_vendor: attr("sys_vendor"),
        product_name: attr("product_name"),
        product_family: attr("product_family"),
        product_uuid: attr("product_uuid").map(|u| u.to_ascii_lowercase()),
        bios_vendor: attr("bios_vendor"),
    };
    if dmi == Dmi::default() {
        return match root.list_dir("sys/class/dmi/id") {
            Err(e) => Fact::Error(e.to_string()),
            Ok(_) => Fact::Error("/sys/class/dmi/id has no readable attributes".into()),
        };
    }
    Fact::Value(dmi)
}

/// True when the `flags` line of /proc/cpuinfo lists `hypervisor`.
pub fn cpu_has_hypervisor_flag(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_once(':').is_some_and(|(_, f)| f.split_whitespace().any(|w| w == "hypervisor")))
}

fn read_kernel_headers(root: &Sysroot, release: &str) -> KernelHeaders {
    let path = format!("lib/modules/{release}/build");
    // A `build` link to a removed headers package still exists as a link: look for the
    // Makefile the module build actually needs.
    let present = root.exists(&format!("{path}/Makefile"));
    KernelHeaders { path: Sysroot::display(&path), present }
}

fn read_secure_boot(root: &Sysroot) -> Fact<SecureBoot> {
    if !root.exists("sys/firmware/efi") {
        return Fact::Value(SecureBoot::NotEfi);
    }
    match root.read_bytes(SECURE_BOOT_VAR) {
        Ok(bytes) => parse_secure_boot_var(&bytes).map(Fact::Value).unwrap_or_else(|| {
            Fact::Error(format!("{}: unexpected contents {:02x?}", Sysroot::display(SECURE_BOOT_VAR), bytes))
        }),
        Err(e) if e.is_not_found() => Fact::Value(SecureBoot::Unsupported),
        Err(e) => Fact::Error(e.to_string()),
    }
}

/// efivarfs files are 4 bytes of attributes, then the value: one byte, 1 = enabled.
pub fn parse_secure_boot_var(bytes: &[u8]) -> Option<SecureBoot> {
    match bytes.get(4)? {
        0 => Some(SecureBoot::Disabled),
        1 => Some(SecureBoot::Enabled),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ubuntu_os_release() {
        let text =
            "PRETTY_NAME=\"Ubuntu 22.04.4 LTS\"\nNAME=\"Ubuntu\"\nVERSION_ID=\"22.04\"\nID=ubuntu\nID_LIKE=debian\n";
        let os = parse_os_release(text);
        assert_eq!(os.id, "ubuntu");
        assert_eq!(os.version_id, "22.04");
        assert_eq!(os.id_like, vec!["debian"]);
        assert_eq!(os.pretty_name, "Ubuntu 22.04.4 LTS");
    }

    #[test]
    fn rocky_os_release() {
        let text = "NAME=\"Rocky Linux\"\nVERSION=\"9.4 (Blue Onyx)\"\nID=\"rocky\"\nID_LIKE=\"rhel centos fedora\"\nVERSION_ID=\"9.4\"\n";
        let os = parse_os_release(text);
        assert_eq!(os.id, "rocky");
        assert_eq!(os.id_like, vec!["rhel", "centos", "fedora"]);
        assert_eq!(os.version_id, "9.4");
    }

    #[test]
    fn secure_boot_var() {
        assert_eq!(parse_secure_boot_var(&[6, 0, 0, 0, 1]), Some(SecureBoot::Enabled));
        assert_eq!(parse_secure_boot_var(&[6, 0, 0, 0, 0]), Some(SecureBoot::Disabled));
        assert_eq!(parse_secure_boot_var(&[6, 0]), None);
    }

    #[test]
    fn hypervisor_flag() {
        assert!(cpu_has_hypervisor_flag("processor\t: 0\nflags\t\t: fpu vme hypervisor lahf_lm\n"));
        assert!(!cpu_has_hypervisor_flag("flags\t\t: fpu vme\n"));
    }

    proptest! {
        #[test]
        fn os_release_never_panics(s in ".*") {
            let _ = parse_os_release(&s);
        }

        #[test]
        fn cpuinfo_never_panics(s in ".*") {
            let _ = cpu_has_hypervisor_flag(&s);
        }

        #[test]
        fn secure_boot_never_panics(b in proptest::collection::vec(any::<u8>(), 0..16)) {
            let _ = parse_secure_boot_var(&b);
        }
    }
}
