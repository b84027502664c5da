//! pci.*: the GPUs and NVSwitches on the guest's PCI bus, their drivers, BARs and links.

use super::{describe_gpus, Finding, Settings};
use crate::facts::{self, NVSWITCHES_PER_HGX_BOARD};
use crate::snapshot::{Fact, PciDevice, Snapshot, NVIDIA_VENDOR};

const NOUVEAU_REMEDY: &str = "Blacklist nouveau: write /etc/modprobe.d/blacklist-nouveau.conf with `blacklist nouveau` and `options nouveau modeset=0`, rebuild the initramfs (`update-initramfs -u`, or `dracut --force` on RHEL), and reboot. `phq-agent install` does all of this.";

pub fn run(s: &Snapshot, settings: &Settings, out: &mut Vec<Finding>) {
    let devices = match &s.pci {
        Fact::Value(d) => d,
        Fact::Error(e) => {
            for id in super::CATALOG.iter().filter(|id| id.starts_with("pci.")) {
                out.push(Finding::unknown(id, format!("cannot list PCI devices: {e}")));
            }
            return;
        }
    };
    let gpus = s.gpus();
    out.push(gpu_present(s, devices.len(), settings.expected_gpus));
    out.push(gpu_count(s, settings));
    if gpus.is_empty() {
        for id in ["pci.gpu-driver-bound", "pci.bar1-assigned", "pci.link"] {
            out.push(Finding::pass(id, "no NVIDIA GPU: nothing to check"));
        }
    }
    for g in &gpus {
        out.push(driver_bound(s, g));
        out.push(bar1_assigned(s, g, gpus.len()));
        out.push(link(g));
    }
    out.push(nvswitch_present(s));
}

/// Whose move a VM without a GPU is depends on what its spec asked for, which the guest cannot
/// read: with `agent.expected_gpus` (cloud-init writes it from the allocation) the platform's
/// allocation failed — `restart_vm`; without it the guest cannot tell a spec that asks for no
/// GPU (the tenant's `fix_vm_spec`) from a GPU the platform did not attach, says so, and routes
/// to the platform's support (`route`: the evidence's `expected_gpus` is null).
fn gpu_present(s: &Snapshot, devices: usize, expected: Option<u32>) -> Finding {
    const ID: &str = "pci.gpu-present";
    let gpus = s.gpus();
    if gpus.is_empty() {
        let nvidia_other: Vec<String> = s
            .pci
            .value()
            .into_iter()
            .flatten()
            .filter(|d| d.vendor == Some(NVIDIA_VENDOR))
            .map(|d| d.address.clone())
            .collect();
        let spec = "Add the GPU to the VirtualMachine (`spec.domain.devices.gpus[]` with a `deviceName` the cluster permits in `permittedHostDevices.pciHostDevices`, e.g. selector `10DE:2330`), check that the node advertises it (`kubectl describe node`, allocatable `nvidia.com/…`), and restart the VM.";
        let f = match expected.filter(|n| *n > 0) {
            Some(n) => Finding::fail(ID, format!("no NVIDIA GPU on the PCI bus; this VM was given {n} (agent.expected_gpus)"))
                .detail(format!("{devices} PCI devices seen, none an NVIDIA GPU (vendor 10de, class 0302). The configuration says the VM was allocated {n} GPU(s), so the platform's allocation did not reach the guest."))
                .remedy("The platform's move: restart the VM from the platform (a new QEMU process re-attaches its devices), and if the GPU stays missing, check the node's devices and the VirtualMachine's spec."),
            None => Finding::fail(ID, "no NVIDIA GPU on the PCI bus; whose move it is cannot be told from inside the guest")
                .detail(format!("{devices} PCI devices seen, none an NVIDIA GPU (vendor 10de, class 0302). The guest cannot read its VirtualMachine's spec: if the spec asks for no GPU, adding one is the tenant's (fix_vm_spec); if it asks for one, the platform did not attach it (restart_vm). Set agent.expected_gpus so the agent can tell."))
                .remedy(format!("Check the VirtualMachine's spec. If it asks for no GPU: {spec} If it does, the platform's support must look at why the GPU was not attached.")),
        };
        return f
            .evidence("pci_devices", devices)
            .evidence("other_nvidia_devices", nvidia_other)
            .evidence("expected_gpus", expected);
    }
    let addrs: Vec<&str> = gpus.iter().map(|g| g.address.as_str()).collect();
    Finding::pass(
        ID,
        format!("{} NVIDIA GPU{}: {}", gpus.len(), if gpus.len() == 1 { "" } else { "s" }, describe_gpus(s)),
    )
    .evidence("gpus", addrs)
}

fn gpu_count(s: &Snapshot, settings: &Settings) -> Finding {
    const ID: &str = "pci.gpu-count";
    let n = s.gpus().len();
    match settings.expected_gpus {
        None => Finding::pass(ID, format!("{n} GPU(s); no expected count configured")).detail("Set `agent.expected_gpus` to have a missing GPU fail this check.").evidence("seen", n),
        Some(e) if e as usize == n => Finding::pass(ID, format!("{n} GPU(s), as expected")).evidence("seen", n).evidence("expected", e),
        Some(e) => Finding::fail(ID, format!("{n} GPU(s) visible, {e} expected"))
            .detail("A GPU the VM was given is missing from its PCI bus, or the VM was given a different number than configured.")
            .remedy("Compare `spec.domain.devices.gpus[]` of the VirtualMachine with `agent.expected_gpus`; if they agree, a GPU may have fallen off the bus on the host (Xid 79): restart the VM, and report it if the GPU stays missing.")
            .evidence("seen", n)
            .evidence("expected", e),
    }
}

fn driver_bound(s: &Snapshot, g: &PciDevice) -> Finding {
    const ID: &str = "pci.gpu-driver-bound";
    let nvidia_loaded = s.driver.modules.value().is_some_and(|m| m.iter().any(|n| n == "nvidia"));
    let cmdline = s.host.cmdline.value().cloned().unwrap_or_default();
    let f = match g.driver.as_deref() {
        Some("nvidia") => Finding::pass(ID, "bound to nvidia"),
        Some("nouveau") => Finding::fail(ID, "bound to nouveau, not nvidia")
            .detail("The open-source nouveau driver claimed the GPU, so the NVIDIA driver cannot; CUDA and NVML see nothing.")
            .remedy(NOUVEAU_REMEDY),
        Some("vfio-pci") => {
            let source = if cmdline.contains("vfio-pci.ids") || cmdline.contains("vfio_pci.ids") { "the kernel command line (`vfio-pci.ids=`)" } else { "a driver override (driverctl, a udev rule, or a `softdep`/`options vfio-pci ids=` in modprobe.d)" };
            Finding::fail(ID, "bound to vfio-pci inside the guest")
                .detail(format!("vfio-pci belongs on the host; inside the VM it keeps the GPU from the NVIDIA driver. It was probably bound by {source}."))
                .remedy(format!("Remove that binding, then `echo {a} > /sys/bus/pci/drivers/vfio-pci/unbind && echo {a} > /sys/bus/pci/drivers/nvidia/bind` (or `modprobe nvidia`), or reboot.", a = g.address))
        }
        Some(other) => Finding::fail(ID, format!("bound to {other}, not nvidia")).remedy(format!("Unbind it (`echo {a} > /sys/bus/pci/drivers/{other}/unbind`) and load nvidia (`modprobe nvidia`).", a = g.address)),
        None if nvidia_loaded => Finding::fail(ID, "no driver bound although the nvidia module is loaded")
            .detail("The driver looked at the GPU and refused it: typically an unassigned BAR, `RmInitAdapter failed`, or a GPU that fell off the bus.")
            .remedy("Read `dmesg | grep NVRM` for the reason; see pci.bar1-assigned and gpu.xid below."),
        None => Finding::fail(ID, "no driver bound: the nvidia module is not loaded")
            .remedy("Run `phq-agent install` (or, if the driver is installed, `modprobe nvidia` and read `dmesg` for why it did not load)."),
    };
    f.gpu(&g.address).evidence("driver", &g.driver)
}

/// OVMF's 64-bit MMIO window must hold every GPU's BARs; this suggests a power of two with
/// room to spare (BAR0 16 MiB + BAR1 128 GiB + BAR2 32 MiB per H100, as `lspci -vvv` of an HGX H100 host
/// shows them; docs/reference.md).
pub fn suggested_mmio64_mb(gpus: usize) -> u64 {
    let need_mb = (gpus.max(1) as u64) * (128 * 1024 + 64) + 1024;
    need_mb.next_power_of_two()
}

fn bar1_assigned(s: &Snapshot, g: &PciDevice, gpus: usize) -> Finding {
    const ID: &str = "pci.bar1-assigned";
    let log_errors: Vec<&crate::snapshot::BarError> =
        s.kernel_log.value().map(|l| l.bar_errors.iter().filter(|b| b.pci == g.address).collect()).unwrap_or_default();
    // BAR1, the framebuffer aperture, is the second 64-bit BAR: resource index 2.
    let (bar0, bar1) = (g.bar(0), g.bar(2));
    if g.bars.is_empty() && log_errors.is_empty() {
        return Finding::unknown(ID, format!("cannot read the GPU's resources: {}", g.problems.join("; ")))
            .gpu(&g.address);
    }
    let unassigned: Vec<&str> = [("BAR0", bar0), ("BAR1", bar1)]
        .iter()
        .filter(|(_, b)| !b.is_some_and(|b| b.assigned()))
        .map(|(n, _)| *n)
        .collect();
    let f = if unassigned.is_empty() && log_errors.is_empty() {
        let size = bar1.map(|b| b.size).unwrap_or(0);
        Finding::pass(ID, format!("BAR1 {} assigned", human_bytes(size)))
    } else {
        let what = if unassigned.is_empty() {
            "the nvidia driver reports an invalid BAR".to_string()
        } else {
            format!("{} not assigned", unassigned.join(" and "))
        };
        Finding::fail(ID, what)
            .detail("The guest firmware's 64-bit MMIO window is too small for the GPUs' BARs (128 GiB of BAR1 per H100), so the kernel left a BAR unplaced and the driver cannot use the GPU (kubevirt/kubevirt#11093).")
            .remedy(format!(
                "Give the VM a larger 64-bit PCI MMIO window: use the host-passthrough CPU model (`spec.domain.cpu.model: host-passthrough`) so OVMF sizes the window from the host's physical address bits, or set OVMF's `X-PciMmio64Mb` to at least {} for {gpus} GPU(s); then restart the VM.",
                suggested_mmio64_mb(gpus)
            ))
            .evidence("kernel_log", log_errors.iter().map(|b| b.message.clone()).collect::<Vec<_>>())
    };
    f.gpu(&g.address).evidence("bar0", bar0).evidence("bar1", bar1)
}

fn link(g: &PciDevice) -> Finding {
    const ID: &str = "pci.link";
    let l = &g.link;
    let f = match (l.current_width, l.max_width) {
        (Some(cur), Some(max)) if cur < max => Finding::warn(ID, format!("link width x{cur} of x{max}"))
            .detail("A narrower link than the GPU supports cuts host↔device bandwidth in proportion; GPUs lower their link speed when idle, but not their width.")
            .remedy("Report it to the platform with the GPU's PCI address: the card or riser on the host needs reseating or replacing. Confirm with `phq-agent probe` (probe.h2d-bandwidth)."),
        (Some(cur), Some(max)) => {
            let speed = match (l.current_gts, l.max_gts) {
                (Some(c), Some(m)) if c < m => format!(", {c} of {m} GT/s (GPUs lower link speed when idle; gpu.pcie-link judges it under NVML)"),
                (Some(c), _) => format!(", {c} GT/s"),
                _ => String::new(),
            };
            Finding::pass(ID, format!("x{cur} of x{max}{speed}"))
        }
        _ => Finding::pass(ID, "link attributes not exposed for this device in the VM").detail("gpu.pcie-link reads the link through NVML instead."),
    };
    f.gpu(&g.address).evidence("link", l)
}

fn nvswitch_present(s: &Snapshot) -> Finding {
    const ID: &str = "pci.nvswitch-present";
    let gpus = s.gpus();
    let switches = s.nvswitches();
    let sxm = gpus.iter().filter(|g| g.device.and_then(facts::sku).is_some_and(|k| k.sxm)).count();
    let addrs: Vec<&str> = switches.iter().map(|d| d.address.as_str()).collect();
    let f = if gpus.is_empty() && switches.is_empty() {
        Finding::pass(ID, "no NVIDIA GPU or NVSwitch")
    } else if switches.is_empty() {
        Finding::pass(ID, "no NVSwitch visible: fabric manager is not needed in this VM")
            .detail(if sxm > 1 { "These SXM GPUs reach each other over NVLink only if the host's fabric manager set it up (shared NVSwitch mode); nvidia-fabricmanager must not run in this guest." } else { "Without NVSwitches in the guest, nvidia-fabricmanager has nothing to manage and must not run here." })
    } else if switches.len() < NVSWITCHES_PER_HGX_BOARD && sxm >= 8 {
        Finding::warn(ID, format!("{} of the {NVSWITCHES_PER_HGX_BOARD} NVSwitches of an HGX board visible", switches.len()))
            .detail("With full passthrough the VM needs every NVSwitch of the board; with some missing, the fabric manager cannot train NVLink and CUDA fails with error 802.")
            .remedy("Pass all four NVSwitches to the VM (`spec.domain.devices.hostDevices`), or none (shared NVSwitch mode, fabric manager on the host).")
    } else {
        Finding::pass(ID, format!("{} NVSwitch(es) visible: nvidia-fabricmanager must run in this VM", switches.len()))
            .detail("Full HGX passthrough: the guest owns the NVSwitches and must run nvidia-fabricmanager at exactly the driver's version, or CUDA fails with error 802.")
    };
    f.evidence("nvswitches", addrs).evidence("sxm_gpus", sxm)
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
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

    fn gpu_mut(s: &mut Snapshot, i: usize) -> &mut PciDevice {
        match &mut s.pci {
            Fact::Value(d) => &mut d[i],
            Fact::Error(_) => unreachable!(),
        }
    }

    #[test]
    fn nouveau_bound_names_each_gpu() {
        let mut s = healthy();
        gpu_mut(&mut s, 3).driver = Some("nouveau".into());
        let f = findings(&s);
        let bad: Vec<_> =
            find(&f, "pci.gpu-driver-bound").into_iter().filter(|f| f.severity == Severity::Fail).collect();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].gpu.as_deref(), Some("0000:0c:00.0"));
        assert!(bad[0].remedy.as_ref().unwrap().contains("blacklist nouveau"));
    }

    #[test]
    fn vfio_bound_blames_cmdline_when_it_says_so() {
        let mut s = healthy();
        s.host.cmdline = Fact::Value("ro vfio-pci.ids=10de:2330".into());
        gpu_mut(&mut s, 0).driver = Some("vfio-pci".into());
        let f = findings(&s);
        let b = find(&f, "pci.gpu-driver-bound")[0];
        assert_eq!(b.severity, Severity::Fail);
        assert!(b.detail.contains("vfio-pci.ids="));
        assert!(b.remedy.as_ref().unwrap().contains("0000:09:00.0"));
    }

    #[test]
    fn bar1_zero_fails_with_mmio_advice() {
        let mut s = healthy();
        gpu_mut(&mut s, 1).bars[1] = Bar { index: 2, start: 0, size: 0, flags: 0 };
        let f = findings(&s);
        let bad: Vec<_> = find(&f, "pci.bar1-assigned").into_iter().filter(|f| f.severity == Severity::Fail).collect();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].gpu.as_deref(), Some("0000:0a:00.0"));
        let r = bad[0].remedy.as_ref().unwrap();
        assert!(r.contains("host-passthrough") && r.contains("X-PciMmio64Mb") && r.contains("2097152"), "{r}");
    }

    #[test]
    fn bar_error_in_kernel_log_fails_even_if_sysfs_looks_fine() {
        let mut s = healthy();
        s.kernel_log = Fact::Value(KernelLog {
            bar_errors: vec![BarError {
                pci: "0000:10:00.0".into(),
                bar: 1,
                size_mib: 0,
                address: 0,
                message: "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:10:00.0)".into(),
            }],
            ..Default::default()
        });
        let f = findings(&s);
        let bad: Vec<_> = find(&f, "pci.bar1-assigned").into_iter().filter(|f| f.severity == Severity::Fail).collect();
        assert_eq!(bad[0].gpu.as_deref(), Some("0000:10:00.0"));
    }

    #[test]
    fn no_gpu_fails_presence_and_passes_the_rest() {
        let mut s = healthy();
        s.pci = Fact::Value(vec![]);
        let f = findings(&s);
        assert_eq!(find(&f, "pci.gpu-present")[0].severity, Severity::Fail);
        assert!(f.iter().filter(|x| x.id != "pci.gpu-present").all(|x| x.severity == Severity::Pass));
    }

    #[test]
    fn narrow_link_warns_slow_idle_link_passes() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).link.current_width = Some(8);
        gpu_mut(&mut s, 1).link.current_gts = Some(2.5);
        let f = findings(&s);
        let links = find(&f, "pci.link");
        assert_eq!(links[0].severity, Severity::Warn);
        assert_eq!(links[1].severity, Severity::Pass);
        assert!(links[1].summary.contains("idle"));
    }

    #[test]
    fn partial_nvswitch_set_warns() {
        let mut s = healthy();
        if let Fact::Value(d) = &mut s.pci {
            d.truncate(10);
        }
        let f = findings(&s);
        assert_eq!(find(&f, "pci.nvswitch-present")[0].severity, Severity::Warn);
    }

    #[test]
    fn expected_count() {
        let mut out = Vec::new();
        run(&healthy(), &Settings { expected_gpus: Some(4), ..Settings::default() }, &mut out);
        assert_eq!(find(&out, "pci.gpu-count")[0].severity, Severity::Fail);
    }

    #[test]
    fn mmio_suggestion() {
        assert_eq!(suggested_mmio64_mb(1), 262144);
        assert_eq!(suggested_mmio64_mb(8), 2097152);
        assert_eq!(human_bytes(128 << 30), "128 GiB");
    }
}
