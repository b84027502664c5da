//! check: pure functions from a `Snapshot` to `Finding`s.
//!
//! The rules of this room:
//! 1. No I/O, no clock: a check reads the snapshot (and `Settings`) and nothing else; every
//!    number it judges by comes from `facts`.
//! 2. Every documented check id (docs/checks.md) appears in `CATALOG`; `run` returns at least
//!    one finding for each, so nothing is ever silently skipped: a check this build cannot
//!    perform says so as `unknown` with the reason, and one that does not apply passes with a
//!    detail saying why.
//! 3. One file per area judged; helpers the areas share (`gpu_label`, `missing`, …) live here,
//!    never in one sibling the others import back.
//! 4. Imports go down only: `snapshot`, `facts`, `config` and `collect`'s pure parsers, never
//!    `probe`, `report`, `serve` or `cli` (tests/rooms.rs holds the order).

pub mod cuda;
pub mod driver;
pub mod fabric;
pub mod gpu;
pub mod host;
pub mod memory;
pub mod nvlink;
pub mod nvml;
pub mod pci;
pub mod route;
pub mod thermal;
pub mod xid;

use crate::snapshot::Snapshot;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Pass,
    Unknown,
    Warn,
    Fail,
}

impl Severity {
    pub fn label(self) -> &'static str {
        match self {
            Severity::Pass => "PASS",
            Severity::Unknown => "UNKNOWN",
            Severity::Warn => "WARN",
            Severity::Fail => "FAIL",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub id: String,
    pub severity: Severity,
    /// The GPU this is about (PCI address; the UUID once NVML supplies it).
    pub gpu: Option<String>,
    pub summary: String,
    pub detail: String,
    /// What to do, concretely. Set on every finding that is not a pass.
    pub remedy: Option<String>,
    /// The values that decided it.
    pub evidence: BTreeMap<String, serde_json::Value>,
    /// What to do (a closed vocabulary, `route::Action`) and whose move it is; set by
    /// `route::apply` when the report is built. Absent in reports of older agents.
    #[serde(default)]
    pub action: route::Action,
    #[serde(default)]
    pub owner: route::Owner,
}

impl Finding {
    fn new(id: &str, severity: Severity, summary: impl Into<String>) -> Self {
        Finding {
            id: id.into(),
            severity,
            gpu: None,
            summary: summary.into(),
            detail: String::new(),
            remedy: None,
            evidence: BTreeMap::new(),
            action: route::Action::None,
            owner: route::Owner::None,
        }
    }
    pub fn pass(id: &str, summary: impl Into<String>) -> Self {
        Self::new(id, Severity::Pass, summary)
    }
    pub fn warn(id: &str, summary: impl Into<String>) -> Self {
        Self::new(id, Severity::Warn, summary)
    }
    pub fn fail(id: &str, summary: impl Into<String>) -> Self {
        Self::new(id, Severity::Fail, summary)
    }
    /// Could not check; `why` becomes the summary, so it is never lost.
    pub fn unknown(id: &str, why: impl Into<String>) -> Self {
        Self::new(id, Severity::Unknown, why)
    }
    pub fn gpu(mut self, gpu: impl Into<String>) -> Self {
        self.gpu = Some(gpu.into());
        self
    }
    pub fn detail(mut self, d: impl Into<String>) -> Self {
        self.detail = d.into();
        self
    }
    pub fn remedy(mut self, r: impl Into<String>) -> Self {
        self.remedy = Some(r.into());
        self
    }
    pub fn evidence(mut self, key: &str, value: impl Serialize) -> Self {
        self.evidence.insert(key.into(), serde_json::to_value(value).unwrap_or(serde_json::Value::Null));
        self
    }
}

/// What checks need from the configuration: kept apart from `Config` so checks stay pure data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub expected_gpus: Option<u32>,
    /// The CUDA 12.x toolkit the installer targets (`install.cuda`).
    pub cuda: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { expected_gpus: None, cuda: "12.4".into() }
    }
}

impl From<&crate::config::Config> for Settings {
    fn from(c: &crate::config::Config) -> Self {
        Settings { expected_gpus: c.agent.expected_gpus, cuda: c.install.cuda.clone() }
    }
}

/// Every check id (documented in docs/checks.md), in report order.
pub const CATALOG: &[&str] = &[
    "host.os-supported",
    "host.virtualization",
    "host.kernel-headers",
    "host.secure-boot",
    "host.hung-tasks",
    "pci.gpu-present",
    "pci.gpu-count",
    "pci.gpu-driver-bound",
    "pci.bar1-assigned",
    "pci.nvswitch-present",
    "pci.link",
    "driver.nouveau-disabled",
    "driver.module-loaded",
    "driver.open-kernel-module",
    "driver.version-consistent",
    "driver.branch-supported",
    "driver.kernel-taint",
    "driver.next-kernel",
    "driver.device-nodes",
    "driver.persistence",
    "nvml.init",
    "nvml.responsive",
    "cuda.driver-api",
    "cuda.init",
    "cuda.toolkit",
    "cuda.toolkit-driver-compatible",
    "fabric.manager-running",
    "fabric.manager-version",
    "fabric.state",
    "fabric.sxid",
    "nvlink.links-active",
    "nvlink.errors",
    "gpu.xid",
    "gpu.ecc-mode",
    "gpu.ecc-uncorrectable",
    "gpu.sram-ecc",
    "gpu.row-remap",
    "gpu.throttle",
    "gpu.throttle-time",
    "gpu.temperature",
    "gpu.power-limit",
    "gpu.pcie-link",
    "gpu.pcie-replay",
    "gpu.mig-pending",
    "gpu.inforom",
    "gpu.sku-known",
    "gpu.firmware-consistent",
    "probe.h2d-bandwidth",
    "probe.d2h-bandwidth",
    "probe.bidir-bandwidth",
    "probe.d2d-bandwidth",
    "probe.sm-copy-bandwidth",
    "probe.p2p-bandwidth",
    "probe.nvlink-scope",
    "probe.allreduce",
    "probe.nccl-start",
    "probe.memory-integrity",
    "probe.gemm",
    "probe.gemm-tensor",
    "probe.gemm-tensor-fp16",
    "probe.gemm-sustained",
    "probe.gemm-fp64",
    "probe.power",
    "probe.power-limit",
    "probe.cublas",
    "probe.latency",
    "probe.baseline",
    "probe.responsive",
    "agent.platform-reachable",
    "agent.endpoint-auth",
];

/// Checks that only run in some modes: probes when asked for (`doctor --probe`, `probe`),
/// agent checks inside `serve`. `doctor` without those leaves them out rather than calling
/// them unknown, since nothing is wrong with not having asked.
pub fn is_mode_specific(id: &str) -> bool {
    id.starts_with("probe.") || id.starts_with("agent.")
}

/// Runs every check `doctor` runs, in catalogue order.
pub fn run(s: &Snapshot, settings: &Settings) -> Vec<Finding> {
    let mut out = Vec::new();
    host::run(s, &mut out);
    pci::run(s, settings, &mut out);
    driver::run(s, settings, &mut out);
    gpu::run(s, &mut out);
    xid::run(s, &mut out);
    nvml::run(s, &mut out);
    cuda::run(s, &mut out);
    fabric::one_cause(&mut out);
    let order = |id: &str| CATALOG.iter().position(|c| *c == id).unwrap_or(usize::MAX);
    out.sort_by_key(|f| order(&f.id)); // stable: per-GPU findings keep PCI order
    out
}

/// `"8 × H100 SXM5 80GB"`-style labels for the GPUs of a snapshot.
pub fn describe_gpus(s: &Snapshot) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for g in s.gpus() {
        *counts.entry(gpu_model(g)).or_default() += 1;
    }
    counts.iter().map(|(name, n)| format!("{n} × {name}")).collect::<Vec<_>>().join(", ")
}

pub fn gpu_model(g: &crate::snapshot::PciDevice) -> String {
    match g.device.and_then(crate::facts::sku) {
        Some(sku) => sku.name.to_string(),
        None => format!("NVIDIA {:04x}", g.device.unwrap_or(0)),
    }
}

/// The PCI address NVML gives, or its index when it gave none.
pub fn gpu_label(g: &crate::snapshot::NvmlGpu) -> String {
    g.pci_address.value().cloned().unwrap_or_else(|| format!("nvml:{}", g.index))
}

/// A reading that is not there: unknown, with NVML's reason.
fn missing<T>(id: &str, what: &str, v: &crate::snapshot::Nv<T>) -> Finding {
    Finding::unknown(id, format!("{what}: {}", v.why_not()))
}

fn has_nvswitches(s: &Snapshot) -> bool {
    !s.nvswitches().is_empty()
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Hand-built snapshots for unit tests: a healthy 8-GPU KubeVirt guest, edited per test.
    use crate::snapshot::*;

    pub fn gpu(bus: u8) -> PciDevice {
        PciDevice {
            address: format!("0000:{bus:02x}:00.0"),
            vendor: Some(0x10de),
            device: Some(0x2330),
            class: Some(0x030200),
            subsystem_vendor: Some(0x10de),
            subsystem_device: Some(0x16c1),
            driver: Some("nvidia".into()),
            bars: vec![
                Bar { index: 0, start: 0x2140_4200_0000, size: 16 << 20, flags: 0x14220c },
                Bar { index: 2, start: 0x2100_0000_0000, size: 128 << 30, flags: 0x14220c },
                Bar { index: 4, start: 0x2140_0000_0000, size: 32 << 20, flags: 0x14220c },
            ],
            link: PciLink {
                current_speed: Some("32.0 GT/s PCIe".into()),
                max_speed: Some("32.0 GT/s PCIe".into()),
                current_gts: Some(32.0),
                max_gts: Some(32.0),
                current_width: Some(16),
                max_width: Some(16),
            },
            numa_node: None,
            problems: vec![],
        }
    }

    pub fn nvswitch(bus: u8) -> PciDevice {
        PciDevice { device: Some(0x22a3), class: Some(0x068000), driver: Some("nvidia-nvswitch".into()), ..gpu(bus) }
    }

    pub fn healthy() -> Snapshot {
        let mut pci: Vec<PciDevice> = (0x09..0x11).map(gpu).collect();
        pci.extend((0x11..0x15).map(nvswitch));
        Snapshot {
            observed_at: Timestamp::from_unix_millis(1_764_000_000_000),
            sysroot: "/".into(),
            host: Host {
                hostname: Some("vm".into()),
                os: Fact::Value(OsRelease {
                    id: "ubuntu".into(),
                    id_like: vec!["debian".into()],
                    version_id: "22.04".into(),
                    pretty_name: "Ubuntu 22.04.4 LTS".into(),
                }),
                kernel_release: Fact::Value("5.15.0-113-generic".into()),
                cmdline: Fact::Value("ro quiet".into()),
                boot_id: None,
                dmi: Fact::Value(Dmi {
                    sys_vendor: Some("KubeVirt".into()),
                    product_name: Some("None".into()),
                    product_family: Some("KubeVirt".into()),
                    product_uuid: Some("5d307ca9-b3ef-428c-8861-06e72d69f223".into()),
                    bios_vendor: None,
                }),
                cpu_hypervisor_flag: Some(true),
                kernel_headers: Fact::Value(KernelHeaders {
                    path: "/lib/modules/5.15.0-113-generic/build".into(),
                    present: true,
                }),
                secure_boot: Fact::Value(SecureBoot::Disabled),
                uptime_s: Some(3600.0),
                blocked_in_driver: Fact::Value(vec![]),
                vsock_cid: Fact::Value(Some(3)),
            },
            units: Fact::Value(vec![
                UnitState {
                    name: "nvidia-persistenced.service".into(),
                    load_state: "loaded".into(),
                    active_state: "active".into(),
                    sub_state: "running".into(),
                    unit_file_state: "enabled".into(),
                },
                UnitState {
                    name: "nvidia-fabricmanager.service".into(),
                    load_state: "loaded".into(),
                    active_state: "active".into(),
                    sub_state: "running".into(),
                    unit_file_state: "enabled".into(),
                },
            ]),
            cuda: CudaStatus::Ok { driver_api_version: 13000, devices: 8 },
            packages: Fact::Value(vec![Package {
                name: "nvidia-fabricmanager".into(),
                version: "580.82.07-1".into(),
                state: "installed".into(),
                held: false,
            }]),
            pci: Fact::Value(pci),
            driver: Driver {
                modules: Fact::Value(vec!["nvidia_uvm".into(), "nvidia".into()]),
                nvrm: Fact::Value(NvrmVersion { version: "580.82.07".into(), open: true, first_line: String::new() }),
                module_version: Some("580.82.07".into()),
                nouveau: NouveauConfig {
                    blacklisted_in: vec!["/etc/modprobe.d/blacklist-nouveau.conf".into()],
                    modeset_off_in: vec![],
                    unreadable: vec![],
                },
                nouveau_module_available: Some(true),
                device_nodes: ["nvidia-uvm", "nvidiactl"]
                    .iter()
                    .map(|s| s.to_string())
                    .chain((0..8).map(|i| format!("nvidia{i}")))
                    .collect(),
                user_libraries: vec![UserLibrary {
                    name: "libnvidia-ml.so".into(),
                    version: "580.82.07".into(),
                    path: "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.82.07".into(),
                }],
                tainted: Some(0x3000),
                installed_kernels: Fact::Value(vec![InstalledKernel {
                    release: "5.15.0-113-generic".into(),
                    nvidia_module: true,
                }]),
                fabric_manager_binary: true,
            },
            cuda_toolkits: Fact::Value(vec![CudaToolkit {
                path: "/usr/local/cuda-12.4".into(),
                version: Fact::Value("12.4.1".into()),
            }]),
            kernel_log: Fact::Value(KernelLog { source: "/dev/kmsg".into(), records: 100, ..Default::default() }),
            nvml_blocked: vec![],
            nvml: NvmlStatus::Ok(NvmlInfo {
                library: "libnvidia-ml.so.1".into(),
                driver_version: Nv::Value("580.82.07".into()),
                nvml_version: Nv::Value("13.580.82.07".into()),
                cuda_driver_version: Nv::Value(13000),
                devices: (0x09..0x11).enumerate().map(|(i, bus)| nvml_gpu(i as u32, bus)).collect(),
                xid_events: vec![],
                events_error: None,
            }),
        }
    }

    /// A healthy H100 SXM5 as NVML shows it, idle.
    pub fn nvml_gpu(index: u32, bus: u8) -> NvmlGpu {
        NvmlGpu {
            index,
            pci_address: Nv::Value(format!("0000:{bus:02x}:00.0")),
            pci_device_id: Nv::Value(0x233010de),
            name: Nv::Value("NVIDIA H100 80GB HBM3".into()),
            uuid: Nv::Value(format!("GPU-3f1c0b7e-0000-4000-8000-0000000000{bus:02x}")),
            serial: Nv::Value("1650123456789".into()),
            board_part_number: Nv::Value("692-2G520-0200-000".into()),
            vbios_version: Nv::Value("96.00.74.00.0D".into()),
            inforom_image_version: Nv::Value("G520.0200.00.05".into()),
            module_id: Nv::Value(index + 1),
            inforom_valid: Nv::Value(true),
            // A reservation of about 900 MiB (measured on an A100, nvml-wrapper issue #57): free is what is left after it and the used.
            memory: Nv::Value(MemoryInfo {
                total_bytes: 85520809984,
                used_bytes: 8 << 20,
                free_bytes: 85520809984 - (904 << 20) - (8 << 20),
                reserved_bytes: 904 << 20,
            }),
            bar1: Nv::Value(MemoryInfo {
                total_bytes: 137438953472,
                used_bytes: 0,
                free_bytes: 137438953472,
                reserved_bytes: 0,
            }),
            temperature_c: Nv::Value(31),
            slowdown_temperature_c: Nv::Value(87),
            shutdown_temperature_c: Nv::Value(92),
            power_usage_mw: Nv::Value(71000),
            power_limit_mw: Nv::Value(700000),
            default_power_limit_mw: Nv::Value(700000),
            sm_clock_mhz: Nv::Value(345),
            mem_clock_mhz: Nv::Value(2619),
            throttle_reasons: Nv::Value(vec!["gpu_idle".into()]),
            ecc_mode: Nv::Value(CurrentPending { current: true, pending: true }),
            ecc_volatile: Nv::Value(EccCounts { corrected: 0, uncorrected: 0 }),
            ecc_aggregate: Nv::Value(EccCounts { corrected: 0, uncorrected: 0 }),
            violations_ns: Nv::Value(crate::snapshot::VIOLATION_REASONS.iter().map(|r| (r.to_string(), 0)).collect()),
            ecc_sram: Nv::Value(crate::snapshot::EccLocation {
                volatile: EccCounts { corrected: 0, uncorrected: 0 },
                aggregate: EccCounts { corrected: 0, uncorrected: 0 },
            }),
            ecc_dram: Nv::Value(crate::snapshot::EccLocation {
                volatile: EccCounts { corrected: 0, uncorrected: 0 },
                aggregate: EccCounts { corrected: 0, uncorrected: 0 },
            }),
            remapped_rows: Nv::Value(RemappedRows { correctable: 0, uncorrectable: 0, pending: false, failure: false }),
            persistence_mode: Nv::Value(true),
            mig_mode: Nv::Value(CurrentPending { current: false, pending: false }),
            pcie: NvPcie {
                gen_current: Nv::Value(5),
                gen_max: Nv::Value(5),
                width_current: Nv::Value(16),
                width_max: Nv::Value(16),
                replay_counter: Nv::Value(0),
            },
            nvlinks: Nv::Value(
                (0..18)
                    .map(|link| NvLinkInfo {
                        link,
                        active: Nv::Value(true),
                        remote_pci: Nv::Value(format!("0000:{:02x}:00.0", 0x11 + link % 4)),
                        replay_errors: Nv::Value(0),
                        recovery_errors: Nv::Value(0),
                        crc_flit_errors: Nv::Value(0),
                        crc_data_errors: Nv::Value(0),
                    })
                    .collect(),
            ),
            fabric: Nv::Value(FabricInfo {
                state: FabricState::Completed,
                status: "NVML_SUCCESS".into(),
                clique_id: 1,
                cluster_uuid: "00000000-0000-0000-0000-000000000000".into(),
            }),
            processes: Nv::Value(vec![]),
            utilization: Nv::Value(Utilization { gpu: 0, memory: 0 }),
            memory_temperature_c: Nv::Value(35),
            energy_mj: Nv::Value(1_234_567_890),
            // H100 has video decoders (NVDEC) but no encoder; NVML reports the encoder idle.
            encoder_utilization: Nv::Value(0),
            decoder_utilization: Nv::Value(0),
            nvlink_throughput: Nv::Value(NvLinkThroughput { tx_kib: 1 << 20, rx_kib: 1 << 20 }),
            nvlink_p2p: Nv::Value((0x09..0x11u8).filter(|b| *b != bus).map(|b| format!("0000:{b:02x}:00.0")).collect()),
            recovery_action: Nv::Value(0),
            // GPM under a light load, in DCGM's units (every field the agent reads).
            gpm: Nv::Value(crate::snapshot::Gpm {
                interval_ms: 100,
                values: crate::collect::nvml::GPM_FIELDS
                    .iter()
                    .map(|(name, _, unit)| {
                        let v = match unit {
                            crate::collect::nvml::GpmUnit::Percent => 0.05,
                            crate::collect::nvml::GpmUnit::MibPerSecond => 12.0 * 1_048_576.0,
                        };
                        (name.to_string(), v)
                    })
                    .collect(),
            }),
        }
    }

    pub fn find<'a>(f: &'a [super::Finding], id: &str) -> Vec<&'a super::Finding> {
        f.iter().filter(|x| x.id == id).collect()
    }

    /// What the NVML checks (`nvml::run`, every room's per-GPU checks) find in `s`.
    pub fn findings(s: &Snapshot) -> Vec<super::Finding> {
        let mut out = Vec::new();
        super::nvml::run(s, &mut out);
        out
    }

    /// The `i`th GPU NVML lists, to edit.
    pub fn gpu_mut(s: &mut Snapshot, i: usize) -> &mut NvmlGpu {
        match &mut s.nvml {
            NvmlStatus::Ok(n) => &mut n.devices[i],
            _ => unreachable!("testutil snapshots read NVML"),
        }
    }

    /// The warnings and failures: (id, GPU, severity).
    pub fn bad(f: &[super::Finding]) -> Vec<(String, String, super::Severity)> {
        f.iter()
            .filter(|f| f.severity >= super::Severity::Warn)
            .map(|f| (f.id.clone(), f.gpu.clone().unwrap_or_default(), f.severity))
            .collect()
    }

    /// Check `id`'s finding for the first GPU (0000:09:00.0).
    pub fn one(s: &Snapshot, id: &str) -> super::Finding {
        findings(s).into_iter().find(|f| f.id == id && f.gpu.as_deref() == Some("0000:09:00.0")).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    #[test]
    fn every_catalogue_id_is_reported_except_mode_specific() {
        for s in [healthy(), Snapshot { pci: crate::snapshot::Fact::Value(vec![]), ..healthy() }] {
            let findings = run(&s, &Settings::default());
            for id in CATALOG.iter().filter(|id| !is_mode_specific(id)) {
                assert!(findings.iter().any(|f| f.id == *id), "{id} missing");
            }
            for f in &findings {
                assert!(CATALOG.contains(&f.id.as_str()), "{} not in catalogue", f.id);
                if f.severity != Severity::Pass {
                    assert!(
                        f.remedy.is_some() || f.severity == Severity::Unknown,
                        "{} {:?} has no remedy",
                        f.id,
                        f.severity
                    );
                }
            }
        }
    }

    #[test]
    fn healthy_guest_has_no_warning_or_failure() {
        let findings = run(&healthy(), &Settings { expected_gpus: Some(8), ..Settings::default() });
        let bad: Vec<_> = findings.iter().filter(|f| f.severity >= Severity::Warn).collect();
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[test]
    fn docs_list_exactly_the_catalogue() {
        let doc = include_str!("../../docs/checks.md");
        let documented: Vec<&str> = doc.lines().filter_map(|l| l.strip_prefix("### ")).map(str::trim).collect();
        for id in CATALOG {
            assert!(documented.contains(id), "{id} is not documented in docs/checks.md");
        }
        for id in &documented {
            assert!(CATALOG.contains(id), "docs/checks.md documents {id}, which is no check");
        }
    }

    #[test]
    fn gpu_labels() {
        assert_eq!(describe_gpus(&healthy()), "8 × H100 SXM5 80GB");
    }
}
