//! host.*: the guest operating system, the hypervisor, kernel headers, Secure Boot, and tasks
//! hung in the driver.

use super::Finding;
use crate::facts::SUPPORTED_OS;
use crate::snapshot::{Fact, OsRelease, SecureBoot, Snapshot};

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    out.push(os_supported(s));
    out.push(virtualization(s));
    out.push(kernel_headers(s));
    out.push(secure_boot(s));
    out.push(hung_tasks(s));
}

/// host.hung-tasks: processes stuck in the NVIDIA driver (`collect::procs`), and the kernel's
/// hung-task reports of this boot. A GPU that stops answering shows this way before any Xid.
/// A process blocked in the driver fails; a hung-task report alone warns (the task may have
/// waited on something else, a disk or a network file system, and it names the task).
fn hung_tasks(s: &Snapshot) -> Finding {
    const ID: &str = "host.hung-tasks";
    let lines = s.kernel_log.value().map(|k| k.hung_tasks.as_slice()).unwrap_or_default();
    let blocked = match &s.host.blocked_in_driver {
        Fact::Value(b) => b.as_slice(),
        Fact::Error(e) if lines.is_empty() => {
            return Finding::unknown(ID, format!("cannot read the processes: {e}"));
        }
        Fact::Error(_) => &[],
    };
    let named = |pid: u32, comm: &str| format!("{comm} (pid {pid})");
    let f = if !blocked.is_empty() {
        let each: Vec<String> =
            blocked.iter().map(|p| format!("{} holding {}", named(p.pid, &p.comm), p.devices.join(", "))).collect();
        Finding::fail(ID, format!("blocked in the NVIDIA driver: {}", each.join("; ")))
            .detail("In uninterruptible sleep inside the driver and not scheduled since: the GPU is not answering the driver. Such a process cannot be killed, and a GPU reset waits for it.")
            .remedy("Reboot the VM; if the reboot hangs on the stuck process, have the platform restart the VM. If it comes back, collect `phq-agent doctor --bundle` for the platform.")
    } else if !lines.is_empty() {
        let mut each: Vec<String> =
            lines.iter().map(|l| format!("{} blocked for more than {} s", named(l.pid, &l.comm), l.seconds)).collect();
        each.dedup();
        Finding::warn(ID, format!("the kernel reported hung tasks: {}", each.join("; ")))
            .detail("The kernel's hung-task detector names a task that stayed in uninterruptible sleep past hung_task_timeout_secs. None holds an NVIDIA device now, so it may have waited on storage or the network rather than the GPU.")
            .remedy("Look at the kernel log around the report (`journalctl -k`); if the task used the GPU, reboot the VM.")
    } else {
        Finding::pass(ID, "no process is blocked in the NVIDIA driver, and the kernel reported no hung task")
    };
    f.evidence("blocked_in_driver", blocked).evidence("kernel_reports", lines)
}

/// The supported guest this os-release names, if any.
pub fn supported_os(os: &OsRelease) -> Option<&'static str> {
    let major = os.version_id.split('.').next().unwrap_or("");
    SUPPORTED_OS
        .iter()
        .find(|(id, version, _)| {
            *id == os.id && (*version == os.version_id || (!version.contains('.') && *version == major))
        })
        .map(|(_, _, name)| *name)
}

fn os_supported(s: &Snapshot) -> Finding {
    const ID: &str = "host.os-supported";
    let os = match &s.host.os {
        Fact::Value(os) => os,
        Fact::Error(e) => return Finding::unknown(ID, format!("cannot tell the distribution: {e}")),
    };
    let shown = if os.pretty_name.is_empty() { format!("{} {}", os.id, os.version_id) } else { os.pretty_name.clone() };
    let f = match supported_os(os) {
        Some(name) => Finding::pass(ID, format!("{shown} is a supported guest ({name})")),
        None => {
            let names: Vec<&str> = SUPPORTED_OS.iter().map(|(_, _, n)| *n).collect();
            Finding::warn(ID, format!("{shown:?} is not a supported guest"))
                .detail("doctor works on any Linux, but `phq-agent install` refuses guests it has not been built and tested for.")
                .remedy(format!("Use one of: {}; or install the NVIDIA driver (open kernel modules) and CUDA 12 by hand following NVIDIA's guide for your distribution.", names.join(", ")))
        }
    };
    f.evidence("id", &os.id).evidence("version_id", &os.version_id).evidence("id_like", &os.id_like)
}

/// What the guest runs on, from DMI and the CPU's hypervisor flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Virtualization {
    KubeVirt,
    /// A VM of another hypervisor; the DMI vendor when it has one.
    OtherVm(String),
    BareMetal(String),
}

impl Virtualization {
    pub fn label(&self) -> &'static str {
        match self {
            Virtualization::KubeVirt => "kubevirt",
            Virtualization::OtherVm(_) => "vm",
            Virtualization::BareMetal(_) => "bare-metal",
        }
    }
}

pub fn virtualization_of(s: &Snapshot) -> Option<Virtualization> {
    let dmi = s.host.dmi.value();
    let get = |f: fn(&crate::snapshot::Dmi) -> &Option<String>| dmi.and_then(|d| f(d).clone()).unwrap_or_default();
    let (vendor, family, product) = (get(|d| &d.sys_vendor), get(|d| &d.product_family), get(|d| &d.product_name));
    let flag = s.host.cpu_hypervisor_flag;
    if vendor == "KubeVirt" || family == "KubeVirt" {
        Some(Virtualization::KubeVirt)
    } else if flag == Some(true) || ["QEMU", "Red Hat"].contains(&vendor.as_str()) || product.contains("KVM") {
        Some(Virtualization::OtherVm(vendor))
    } else if flag == Some(false) && dmi.is_some() {
        Some(Virtualization::BareMetal(format!("{vendor} {product}").trim().to_string()))
    } else {
        None
    }
}

fn virtualization(s: &Snapshot) -> Finding {
    const ID: &str = "host.virtualization";
    let f = match virtualization_of(s) {
        Some(Virtualization::KubeVirt) => {
            let uuid = s.host.dmi.value().and_then(|d| d.product_uuid.clone());
            Finding::pass(ID, "KubeVirt virtual machine").detail(format!("The agent id defaults to the VM firmware UUID {}.", uuid.as_deref().unwrap_or("(unreadable)")))
        }
        Some(Virtualization::OtherVm(vendor)) => Finding::pass(ID, format!("virtual machine ({}), not KubeVirt", if vendor.is_empty() { "unknown hypervisor" } else { &vendor }))
            .detail("The checks still apply; KubeVirt-specific advice (VM spec fields) may need translating to your hypervisor."),
        Some(Virtualization::BareMetal(what)) => {
            Finding::pass(ID, format!("bare metal ({what})")).detail("Not a VM: passthrough-specific checks (BAR1 window, vfio-pci) still run and simply pass.")
        }
        None => return Finding::unknown(ID, format!("cannot tell: {}", s.host.dmi.error().unwrap_or("DMI and /proc/cpuinfo are unreadable"))),
    };
    f.evidence("dmi", s.host.dmi.value()).evidence("cpu_hypervisor_flag", s.host.cpu_hypervisor_flag)
}

fn kernel_headers(s: &Snapshot) -> Finding {
    const ID: &str = "host.kernel-headers";
    let release = s.host.kernel_release.value().cloned().unwrap_or_default();
    let headers = match &s.host.kernel_headers {
        Fact::Value(h) => h,
        Fact::Error(e) => return Finding::unknown(ID, e.clone()),
    };
    let f = if headers.present {
        Finding::pass(ID, format!("headers for {release} are installed"))
    } else if s.gpus().is_empty() {
        Finding::pass(ID, format!("headers for {release} are not installed; not needed without an NVIDIA GPU"))
    } else {
        let rhel =
            s.host.os.value().is_some_and(|o| o.id_like.iter().any(|l| l == "rhel" || l == "fedora") || o.id == "rhel");
        let cmd = if rhel {
            format!("dnf install kernel-devel-{release} kernel-headers-{release}")
        } else {
            format!("apt-get install linux-headers-{release}")
        };
        Finding::warn(ID, format!("headers for the running kernel {release} are missing"))
            .detail("DKMS needs them to build the nvidia module now and after every kernel update; without them the driver stops loading at the next kernel upgrade.")
            .remedy(format!("`{cmd}` (`phq-agent install` does this), then `dkms autoinstall`."))
    };
    f.evidence("path", &headers.path).evidence("present", headers.present)
}

fn secure_boot(s: &Snapshot) -> Finding {
    const ID: &str = "host.secure-boot";
    let state = match &s.host.secure_boot {
        Fact::Value(v) => *v,
        Fact::Error(e) => return Finding::unknown(ID, format!("cannot read the SecureBoot EFI variable: {e}")),
    };
    let nvidia_loaded = s.driver.modules.value().is_some_and(|m| m.iter().any(|n| n == "nvidia"));
    let f = match state {
        SecureBoot::NotEfi => Finding::pass(ID, "legacy BIOS boot: no Secure Boot, unsigned modules load"),
        SecureBoot::Unsupported => Finding::pass(ID, "UEFI without Secure Boot support"),
        SecureBoot::Disabled => Finding::pass(ID, "Secure Boot is off"),
        SecureBoot::Enabled if nvidia_loaded => Finding::pass(ID, "Secure Boot is on and the nvidia module loaded, so it is signed with a trusted key"),
        SecureBoot::Enabled if s.gpus().is_empty() => Finding::pass(ID, "Secure Boot is on; no NVIDIA GPU to drive"),
        SecureBoot::Enabled => Finding::warn(ID, "Secure Boot is on and the nvidia module is not loaded")
            .detail("KubeVirt enables Secure Boot whenever EFI is used unless the VM says `secureBoot: false`. A DKMS-built nvidia module is unsigned and the kernel refuses it until its key (MOK) is enrolled.")
            .remedy("On Ubuntu install the signed precompiled modules (`linux-modules-nvidia-<branch>-server-open-$(uname -r)`; `phq-agent install` prefers them). Elsewhere enroll the DKMS key: `mokutil --import /var/lib/dkms/mok.pub`, then confirm it on the VM console at the next boot; or set `spec.domain.firmware.bootloader.efi.secureBoot: false` in the VirtualMachine."),
    };
    f.evidence("state", state)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::checks::Severity;

    fn one(s: &Snapshot, id: &str) -> Finding {
        let mut out = Vec::new();
        run(s, &mut out);
        out.into_iter().find(|f| f.id == id).unwrap()
    }

    #[test]
    fn supported_versions() {
        let os = |id: &str, v: &str| OsRelease { id: id.into(), version_id: v.into(), ..Default::default() };
        assert_eq!(supported_os(&os("rocky", "9.4")), Some("Rocky Linux 9"));
        assert_eq!(supported_os(&os("debian", "12")), Some("Debian 12"));
        assert_eq!(supported_os(&os("ubuntu", "22.10")), None);
        assert_eq!(supported_os(&os("ubuntu", "24.04")), Some("Ubuntu 24.04"));
        assert_eq!(supported_os(&os("debian", "11")), None);
    }

    #[test]
    fn unsupported_os_warns_with_the_list() {
        let mut s = healthy();
        s.host.os =
            Fact::Value(OsRelease { id: "arch".into(), pretty_name: "Arch Linux".into(), ..Default::default() });
        let f = one(&s, "host.os-supported");
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.remedy.unwrap().contains("Ubuntu 22.04"));
    }

    #[test]
    fn secure_boot_without_module_warns_with_mok_steps() {
        let mut s = healthy();
        s.host.secure_boot = Fact::Value(SecureBoot::Enabled);
        assert_eq!(one(&s, "host.secure-boot").severity, Severity::Pass);
        s.driver.modules = Fact::Value(vec![]);
        let f = one(&s, "host.secure-boot");
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.remedy.unwrap().contains("mokutil"));
    }

    #[test]
    fn missing_headers_name_the_package() {
        let mut s = healthy();
        s.host.kernel_headers =
            Fact::Value(crate::snapshot::KernelHeaders { path: "/lib/modules/x/build".into(), present: false });
        let f = one(&s, "host.kernel-headers");
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.remedy.unwrap().contains("linux-headers-5.15.0-113-generic"));
    }

    #[test]
    fn virtualization_kinds() {
        let s = healthy();
        assert_eq!(one(&s, "host.virtualization").summary, "KubeVirt virtual machine");
        let mut s = healthy();
        s.host.dmi = Fact::Error("/sys/class/dmi/id: No such file or directory".into());
        s.host.cpu_hypervisor_flag = None;
        assert_eq!(one(&s, "host.virtualization").severity, Severity::Unknown);
    }
}
