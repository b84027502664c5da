//! The scenario file (format v1, docs/fake-nvml-scenario.md). Every field is optional: an
//! absent one makes its NVML call answer `NVML_ERROR_NOT_SUPPORTED`. Unknown fields are kept
//! out with `deny_unknown_fields` so a typo in a test scenario fails loudly instead of
//! silently testing "not supported".

use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub init_error: Option<String>,
    /// How long `nvmlInit_v2` takes. The real one attaches every GPU, which takes seconds on an
    /// 8-GPU guest without persistence mode (NVIDIA's driver persistence documentation: with
    /// no client holding the GPUs, each initialisation sets them up again).
    pub init_delay_ms: Option<u64>,
    pub driver_version: Option<String>,
    pub nvml_version: Option<String>,
    pub cuda_driver_version: Option<i32>,
    #[serde(default)]
    pub devices: Vec<Device>,
    /// NVML calls that block instead of answering, as on a GPU that has fallen off the bus
    /// (Xid 79) or whose GSP stopped answering (Xid 119): see `hang` in lib.rs for the sources.
    #[serde(default)]
    pub hangs: Vec<Hang>,
}

/// One blocking call: `function` (an NVML name from `lib.rs`'s `HANGABLE`), on GPU `gpu` (an
/// index; absent: every GPU, or a call about no GPU), until `until_ms` after the process's first
/// `nvmlInit_v2` (a driver that recovers; absent: until the process ends). A call made after
/// that time answers at once.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hang {
    pub function: String,
    #[serde(default)]
    pub gpu: Option<usize>,
    #[serde(default)]
    pub until_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub serial: Option<String>,
    pub board_part_number: Option<String>,
    pub vbios_version: Option<String>,
    pub inforom_image_version: Option<String>,
    /// `nvmlDeviceGetModuleId`; absent: NVML_ERROR_NOT_SUPPORTED.
    pub module_id: Option<u32>,
    /// `nvmlDeviceGetViolationStatus`'s violation time in ns, by reason (`power`, `thermal`,
    /// `sync_boost`, `board_limit`, `low_utilization`, `reliability`, `total_app_clocks`,
    /// `total_base_clocks`); a reason absent: NVML_ERROR_NOT_SUPPORTED.
    #[serde(default)]
    pub violations_ns: std::collections::BTreeMap<String, u64>,
    pub inforom_valid: Option<bool>,
    pub pci: Option<Pci>,
    pub memory: Option<Memory>,
    pub bar1: Option<Memory>,
    pub temperature_c: Option<u32>,
    pub slowdown_temperature_c: Option<u32>,
    pub shutdown_temperature_c: Option<u32>,
    pub power_usage_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub default_power_limit_mw: Option<u32>,
    pub clocks_mhz: Option<Clocks>,
    pub throttle_reasons: Option<Vec<String>>,
    pub ecc: Option<Ecc>,
    pub remapped_rows: Option<RemappedRows>,
    pub persistence_mode: Option<bool>,
    pub mig: Option<Mig>,
    pub pcie: Option<Pcie>,
    pub nvlinks: Option<Vec<NvLink>>,
    pub fabric: Option<Fabric>,
    pub processes: Option<Vec<Process>>,
    pub utilization: Option<Utilization>,
    /// HBM temperature, answered for field `NVML_FI_DEV_MEMORY_TEMP`.
    pub memory_temperature_c: Option<u32>,
    /// `nvmlDeviceGetTotalEnergyConsumption`, millijoules.
    pub energy_mj: Option<u64>,
    /// The GPU's recovery action, answered for field `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (230) as
    /// an unsigned int: nvml.h's `nvmlDeviceGpuRecoveryAction_t` (0 none, 1 GPU reset, 2 node
    /// reboot, 3 drain P2P, 4 drain and reset). Absent: the field is not supported (a driver
    /// before R565, or a VM's driver that does not report it).
    pub recovery_action: Option<u32>,
    /// `nvmlDeviceGetEncoderUtilization` / `DecoderUtilization`, percent.
    pub encoder_utilization: Option<u32>,
    pub decoder_utilization: Option<u32>,
    #[serde(default)]
    pub xid_events: Vec<XidEvent>,
    #[serde(default)]
    pub unsupported: Vec<String>,
    /// GPM: absent, the GPU has none (`nvmlGpmQueryDeviceSupport` says so).
    #[serde(default)]
    pub gpm: Option<Gpm>,
    #[serde(default)]
    pub errors: BTreeMap<String, String>,
    /// This GPU's answer to `nvmlDeviceGetP2PStatus` with the NVLink capability: "ok",
    /// "not_supported", "gpu_not_supported", "disabled_by_regkey", "unknown". A pair reaches
    /// over NVLink when both GPUs say "ok"; otherwise the pair gets the first GPU's status (or
    /// the second's). Absent on either GPU: the query is not supported.
    #[serde(default)]
    pub nvlink_p2p: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pci {
    pub bus_id: String,
    pub pci_device_id: String,
    pub pci_subsystem_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    pub total_bytes: u64,
    #[serde(default)]
    pub used_bytes: u64,
    /// What the driver and firmware hold back (v2 memory info); not part of `used_bytes`.
    #[serde(default)]
    pub reserved_bytes: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Clocks {
    pub sm: Option<u32>,
    pub mem: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ecc {
    pub current: Option<bool>,
    pub pending: Option<bool>,
    pub volatile: Option<EccCounts>,
    pub aggregate: Option<EccCounts>,
    /// `nvmlDeviceGetMemoryErrorCounter` by location: on-die SRAM and the HBM (DRAM) apart.
    /// A location absent here answers NVML_ERROR_NOT_SUPPORTED.
    pub sram: Option<EccLocation>,
    pub dram: Option<EccLocation>,
    /// The scenario's fault: each read of the volatile corrected count finds this many more
    /// errors than the read before (a GPU correcting errors while it is used).
    #[serde(default)]
    pub corrected_per_read: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EccCounts {
    pub corrected: u64,
    pub uncorrected: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EccLocation {
    pub volatile: EccCounts,
    pub aggregate: EccCounts,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: bool,
    pub failure: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mig {
    pub current: bool,
    pub pending: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pcie {
    pub gen_current: Option<u32>,
    pub gen_max: Option<u32>,
    pub width_current: Option<u32>,
    pub width_max: Option<u32>,
    pub replay_counter: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvLink {
    pub active: bool,
    /// What the link connects to, `0000:05:00.0` (an NVSwitch on an HGX). Absent: the remote PCI
    /// query is not supported.
    #[serde(default)]
    pub remote_pci: Option<String>,
    #[serde(default)]
    pub crc_flit_errors: u64,
    #[serde(default)]
    pub crc_data_errors: u64,
    #[serde(default)]
    pub replay_errors: u64,
    #[serde(default)]
    pub recovery_errors: u64,
    /// Data sent and received over the link since the driver loaded, KiB (the
    /// `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`/`_RX` fields).
    #[serde(default)]
    pub tx_kib: u64,
    #[serde(default)]
    pub rx_kib: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fabric {
    pub state: String,
    pub status: Option<String>,
    pub cluster_uuid: Option<String>,
    pub clique_id: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Process {
    #[serde(default)]
    pub pid: u32,
    pub used_bytes: u64,
    /// The process that loaded this library, whatever its pid: on a real machine NVML lists the
    /// agent itself once it holds a context on the GPU.
    #[serde(default)]
    pub caller: bool,
    /// Listed from this process's Nth query of the device's list on (`PROCESS_QUERIES` in
    /// lib.rs): a job that starts while the caller watches. Absent: from the first.
    #[serde(default)]
    pub from_query: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Utilization {
    pub gpu: u32,
    pub memory: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XidEvent {
    pub xid: u64,
    #[serde(default)]
    pub after_ms: u64,
}

/// `0x233010DE` or a decimal number.
pub fn parse_u32(s: &str) -> Option<u32> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// The GPM metrics a GPU reports, by NVML's metric id (`nvmlGpmMetricId_t`, as a string key):
/// percentages for utilisations, MiB/s for PCIe and NVLink rates; `null` is a NaN.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Gpm {
    #[serde(default)]
    pub metrics: std::collections::BTreeMap<String, Option<f64>>,
}
