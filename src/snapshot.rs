//! The one data model: what `collect` saw, as plain serde data.
//!
//! A `Snapshot` carries its own time, so checks never read a clock. Everything that could not be
//! read is a `Fact::Error` with the reason (which file, what went wrong): checks turn those into
//! honest `unknown` findings instead of guessing.

use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A value, or why it could not be had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fact<T> {
    Value(T),
    Error(String),
}

impl<T> Fact<T> {
    pub fn value(&self) -> Option<&T> {
        match self {
            Fact::Value(v) => Some(v),
            Fact::Error(_) => None,
        }
    }

    pub fn error(&self) -> Option<&str> {
        match self {
            Fact::Value(_) => None,
            Fact::Error(e) => Some(e),
        }
    }
}

impl<T, E: std::fmt::Display> From<Result<T, E>> for Fact<T> {
    fn from(r: Result<T, E>) -> Self {
        match r {
            Ok(v) => Fact::Value(v),
            Err(e) => Fact::Error(e.to_string()),
        }
    }
}

/// A point in time, written as RFC 3339 (UTC, milliseconds) in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(pub SystemTime);

impl Timestamp {
    pub fn now() -> Self {
        Timestamp(SystemTime::now())
    }

    pub fn from_unix_millis(ms: u64) -> Self {
        Timestamp(UNIX_EPOCH + Duration::from_millis(ms))
    }
}

impl std::fmt::Display for Timestamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_millis(self.0))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&s).map(Timestamp).map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub observed_at: Timestamp,
    /// The root the snapshot was read from (`/` on a live machine).
    pub sysroot: String,
    pub host: Host,
    pub pci: Fact<Vec<PciDevice>>,
    pub driver: Driver,
    pub cuda_toolkits: Fact<Vec<CudaToolkit>>,
    pub kernel_log: Fact<KernelLog>,
    pub nvml: NvmlStatus,
    /// NVML calls that passed their deadline and had not returned when the snapshot was taken
    /// (a driver in recovery, a GPU off the bus); empty when NVML answered everything asked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvml_blocked: Vec<BlockedCall>,
    /// Installed NVIDIA/CUDA packages (dpkg).
    pub packages: Fact<Vec<Package>>,
    /// systemd units of the driver's daemons, asked over D-Bus.
    pub units: Fact<Vec<UnitState>>,
    /// The CUDA driver API: library, version, cuInit.
    pub cuda: CudaStatus,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CudaStatus {
    /// Not asked (a `--sysroot` stands for another machine).
    NotRead(String),
    Failed {
        stage: CudaStage,
        /// The CUresult, when CUDA gave one.
        code: Option<i32>,
        message: String,
    },
    Ok {
        /// `cuDriverGetVersion`: 12040 for CUDA 12.4.
        driver_api_version: i32,
        devices: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CudaStage {
    Library,
    DriverVersion,
    Init,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitState {
    pub name: String,
    /// `loaded`, `not-found`, `masked`, …
    pub load_state: String,
    /// `active`, `inactive`, `failed`, `activating`, …
    pub active_state: String,
    pub sub_state: String,
    /// `enabled`, `disabled`, …
    pub unit_file_state: String,
}

impl UnitState {
    pub fn exists(&self) -> bool {
        self.load_state != "not-found"
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Package {
    pub name: String,
    pub version: String,
    /// dpkg's state word: `installed`, `half-configured`, `unpacked`, …
    pub state: String,
    /// Held at its version (`apt-mark hold`, `dnf versionlock`).
    #[serde(default)]
    pub held: bool,
}

impl Snapshot {
    /// NVIDIA GPUs, in PCI address order.
    pub fn gpus(&self) -> Vec<&PciDevice> {
        self.pci.value().map(|d| d.iter().filter(|d| d.is_nvidia_gpu()).collect()).unwrap_or_default()
    }

    pub fn nvswitches(&self) -> Vec<&PciDevice> {
        self.pci.value().map(|d| d.iter().filter(|d| d.is_nvswitch()).collect()).unwrap_or_default()
    }

    /// A unit's state, when the units could be read.
    pub fn unit(&self, name: &str) -> Option<&UnitState> {
        self.units.value()?.iter().find(|u| u.name == name)
    }

    pub fn nvml(&self) -> Option<&NvmlInfo> {
        match &self.nvml {
            NvmlStatus::Ok(n) => Some(n),
            _ => None,
        }
    }

    /// The NVML view of the GPU at a PCI address.
    pub fn nvml_gpu(&self, address: &str) -> Option<&NvmlGpu> {
        self.nvml()?.devices.iter().find(|g| g.pci_address.value().is_some_and(|a| a == address))
    }
}

/// A snapshot saved before the agent read the vsock device says so rather than "none".
fn vsock_not_read() -> Fact<Option<u32>> {
    Fact::Error("not read: saved by an agent that did not read /dev/vsock".into())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Host {
    pub hostname: Option<String>,
    pub os: Fact<OsRelease>,
    pub kernel_release: Fact<String>,
    pub cmdline: Fact<String>,
    pub boot_id: Option<String>,
    pub dmi: Fact<Dmi>,
    /// The `hypervisor` CPU flag from /proc/cpuinfo: set in every guest of a modern hypervisor.
    pub cpu_hypervisor_flag: Option<bool>,
    pub kernel_headers: Fact<KernelHeaders>,
    pub secure_boot: Fact<SecureBoot>,
    /// The vsock device's local CID (KubeVirt's `status.vsockCID`); `None`: no vsock device.
    #[serde(default = "vsock_not_read")]
    pub vsock_cid: Fact<Option<u32>>,
    /// Seconds since boot (/proc/uptime), to turn counters since boot into rates.
    pub uptime_s: Option<f64>,
    /// Processes blocked in the NVIDIA driver (`collect::procs`).
    #[serde(default = "not_read")]
    pub blocked_in_driver: Fact<Vec<BlockedProcess>>,
}

/// What a snapshot written before a reading existed holds for it (a bundle from an older agent).
fn not_read<T>() -> Fact<T> {
    Fact::Error("not read by the agent that wrote this snapshot".into())
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OsRelease {
    pub id: String,
    pub id_like: Vec<String>,
    pub version_id: String,
    pub pretty_name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Dmi {
    pub sys_vendor: Option<String>,
    pub product_name: Option<String>,
    pub product_family: Option<String>,
    pub product_uuid: Option<String>,
    pub bios_vendor: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelHeaders {
    /// `/lib/modules/<release>/build` as seen in the sysroot.
    pub path: String,
    pub present: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecureBoot {
    /// Booted without UEFI (SeaBIOS in KubeVirt): there is no Secure Boot.
    NotEfi,
    Disabled,
    Enabled,
    /// UEFI, but the `SecureBoot` variable is absent (firmware without the feature).
    Unsupported,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bar {
    /// The resource index as in sysfs `resource` (0–5 BARs, 6 the ROM).
    pub index: u8,
    pub start: u64,
    pub size: u64,
    pub flags: u64,
}

impl Bar {
    /// Linux marks a resource it could not place with `IORESOURCE_UNSET`; a region that was
    /// never sized reads as all zeros. Either way the device cannot use it.
    pub fn assigned(&self) -> bool {
        const IORESOURCE_UNSET: u64 = 0x2000_0000;
        self.size > 0 && self.start != 0 && self.flags & IORESOURCE_UNSET == 0
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PciLink {
    pub current_speed: Option<String>,
    pub max_speed: Option<String>,
    pub current_gts: Option<f64>,
    pub max_gts: Option<f64>,
    pub current_width: Option<u32>,
    pub max_width: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PciDevice {
    /// `0000:09:00.0`
    pub address: String,
    pub vendor: Option<u16>,
    pub device: Option<u16>,
    pub class: Option<u32>,
    pub subsystem_vendor: Option<u16>,
    pub subsystem_device: Option<u16>,
    /// Name of the bound driver (`nvidia`, `nouveau`, `vfio-pci`), `None` when unbound.
    pub driver: Option<String>,
    /// Every resource line of `resource`; regions that were never sized are kept too (all
    /// zeros), since "BAR1 is zero" is exactly what a check must see.
    pub bars: Vec<Bar>,
    pub link: PciLink,
    pub numa_node: Option<i64>,
    /// What could not be read or parsed for this device, each naming the file.
    pub problems: Vec<String>,
}

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;

impl PciDevice {
    /// GPUs are PCI class 0x0302 (3D controller); a few boards show as 0x0300 (VGA).
    pub fn is_nvidia_gpu(&self) -> bool {
        self.vendor == Some(NVIDIA_VENDOR) && matches!(self.class.map(|c| c >> 8), Some(0x0302 | 0x0300))
    }

    /// NVSwitches are bridges (class 0x0680) with their own device ids; see `facts::NVSWITCH_DEVICE_IDS`.
    pub fn is_nvswitch(&self) -> bool {
        self.vendor == Some(NVIDIA_VENDOR)
            && self.device.is_some_and(|d| crate::facts::NVSWITCH_DEVICE_IDS.contains(&d))
    }

    pub fn bar(&self, index: u8) -> Option<&Bar> {
        self.bars.iter().find(|b| b.index == index)
    }

    /// `0000:09:00` — the form the NVIDIA driver prints in `NVRM: Xid (PCI:0000:09:00)`.
    pub fn address_without_function(&self) -> &str {
        self.address.rsplit_once('.').map(|(a, _)| a).unwrap_or(&self.address)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Driver {
    /// Loaded kernel modules from /proc/modules.
    pub modules: Fact<Vec<String>>,
    /// /proc/driver/nvidia/version; an error when the module is not loaded.
    pub nvrm: Fact<NvrmVersion>,
    /// /sys/module/nvidia/version
    pub module_version: Option<String>,
    pub nouveau: NouveauConfig,
    /// Whether this kernel ships a nouveau module at all (`None` when unknown).
    pub nouveau_module_available: Option<bool>,
    /// `/dev/nvidia*` nodes present.
    pub device_nodes: Vec<String>,
    /// NVIDIA user-space libraries found, with the version in their file name.
    pub user_libraries: Vec<UserLibrary>,
    /// `/proc/sys/kernel/tainted`: the kernel's taint flags since boot; None when unreadable.
    #[serde(default)]
    pub tainted: Option<u64>,
    /// The kernels installed in /boot (`vmlinuz-<release>`), each with whether an `nvidia`
    /// module is installed for it under /lib/modules/<release>; an error when /boot is unreadable.
    #[serde(default = "no_kernels")]
    pub installed_kernels: Fact<Vec<InstalledKernel>>,
    /// The fabric manager's program is there (`/usr/bin/nv-fabricmanager`, where NVIDIA's
    /// package and its runfile put it): evidence a fabric manager is installed, whatever the
    /// package database says.
    #[serde(default)]
    pub fabric_manager_binary: bool,
}

fn no_kernels() -> Fact<Vec<InstalledKernel>> {
    Fact::Error("not collected".into())
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstalledKernel {
    pub release: String,
    pub nvidia_module: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvrmVersion {
    pub version: String,
    /// True for "NVIDIA UNIX Open Kernel Module", false for the proprietary module.
    pub open: bool,
    pub first_line: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NouveauConfig {
    /// Files (or `kernel command line`) that blacklist nouveau.
    pub blacklisted_in: Vec<String>,
    /// Files (or `kernel command line`) that set `nouveau modeset=0`.
    pub modeset_off_in: Vec<String>,
    /// modprobe.d files that could not be read, with the reason.
    pub unreadable: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserLibrary {
    pub name: String,
    pub version: String,
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaToolkit {
    pub path: String,
    pub version: Fact<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelLog {
    /// Where the lines came from (`/dev/kmsg`).
    pub source: String,
    pub records: usize,
    /// Lines that were not kernel log records (kept out of the counts, noted for support).
    pub malformed: usize,
    pub xids: Vec<XidEvent>,
    /// NVSwitch SXid reports (`nvidia-nvswitchN: SXid (PCI:…): code, Fatal|Non-fatal, …`).
    #[serde(default)]
    pub sxids: Vec<SxidEvent>,
    pub bar_errors: Vec<BarError>,
    /// `NVRM: GPU at PCI:0000:9b:00: GPU-…` lines, linking PCI addresses to UUIDs.
    pub gpu_uuids: Vec<GpuUuidLine>,
    /// The kernel's hung-task detector: `INFO: task <comm>:<pid> blocked for more than N seconds.`
    #[serde(default)]
    pub hung_tasks: Vec<HungTaskLine>,
}

/// One report of the kernel's hung-task detector (kernel/hung_task.c, `check_hung_task`): a task
/// in uninterruptible sleep that has not been scheduled for `seconds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HungTaskLine {
    pub comm: String,
    pub pid: u32,
    pub seconds: u64,
    pub usec: Option<u64>,
}

/// A process in uninterruptible sleep (state `D`) that holds an NVIDIA device node open, and
/// was still so, not scheduled in between, when read again (`collect::procs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedProcess {
    pub pid: u32,
    pub comm: String,
    /// The `/dev/nvidia*` nodes it holds open.
    pub devices: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidEvent {
    /// `0000:9b:00` as the driver prints it (no function number).
    pub pci: String,
    /// The Xid code; `None` when the number in the line is not one (kept, so it is not lost).
    pub xid: Option<u32>,
    pub raw_code: String,
    /// Microseconds since boot, from the kmsg record.
    pub usec: Option<u64>,
    pub seq: Option<u64>,
    pub message: String,
}

/// One SXid report of the NVSwitch driver. The driver follows a report with lines of detail for
/// the same error (`…: 11004, Severity 0 Engine instance 42 …`, `…: 11004, Data {…}`); those are
/// not reports and are not kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SxidEvent {
    /// The driver's name for the switch, `nvswitch3`.
    pub device: String,
    /// `0000:05:00.0`, as the driver prints it (with the function number).
    pub pci: String,
    /// The SXid; `None` when the number in the line is not one (kept, so it is not lost).
    pub sxid: Option<u32>,
    pub raw_code: String,
    /// The driver's own word: `Fatal` (true) or `Non-fatal` (false).
    pub fatal: bool,
    /// The NVLink port, when the line names one (`Link 32`).
    pub link: Option<u32>,
    /// Microseconds since boot, from the kmsg record.
    pub usec: Option<u64>,
    pub seq: Option<u64>,
    /// What follows the severity word: `Link 32 egress non-posted PRIV error (First)`.
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarError {
    /// `0000:0a:00.0`
    pub pci: String,
    pub bar: u32,
    pub size_mib: u64,
    pub address: u64,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuUuidLine {
    pub pci: String,
    pub uuid: String,
}

/// One NVML reading. Many calls are not supported inside VMs: that is `NotSupported`, never a
/// zero; any other failure keeps NVML's error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Nv<T> {
    Value(T),
    NotSupported,
    Error(String),
}

/// What a snapshot written before a reading existed holds for it (a bundle from an older
/// agent): nothing to report, as for a call the GPU does not support.
impl<T> Default for Nv<T> {
    fn default() -> Self {
        Nv::NotSupported
    }
}

impl<T> Nv<T> {
    pub fn value(&self) -> Option<&T> {
        match self {
            Nv::Value(v) => Some(v),
            _ => None,
        }
    }

    /// The same absence for another type (a value becomes an error: callers use this on
    /// readings they know have none).
    pub fn without_value<U>(&self) -> Nv<U> {
        match self {
            Nv::Value(_) => Nv::Error("no value".into()),
            Nv::NotSupported => Nv::NotSupported,
            Nv::Error(e) => Nv::Error(e.clone()),
        }
    }

    /// The value mapped, the absence kept.
    pub fn map_value<U>(&self, f: impl FnOnce(&T) -> U) -> Nv<U> {
        match self {
            Nv::Value(v) => Nv::Value(f(v)),
            other => other.without_value(),
        }
    }

    /// Why there is no value, in words for a finding.
    pub fn why_not(&self) -> String {
        match self {
            Nv::Value(_) => String::new(),
            Nv::NotSupported => "not supported by NVML on this GPU/VM".into(),
            Nv::Error(e) => e.clone(),
        }
    }
}

/// What NVML said, or why it could not be asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NvmlStatus {
    /// Not asked: a `--sysroot` stands for another machine, so the local NVML is not loaded
    /// unless `--nvml-lib` names one.
    NotRead(String),
    Failed(NvmlFailure),
    Ok(NvmlInfo),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NvmlFailureKind {
    LibraryNotFound,
    DriverNotLoaded,
    VersionMismatch,
    NoPermission,
    /// `nvmlInit_v2` did not return within its deadline (see `Snapshot::nvml_blocked`).
    NotAnswering,
    Other,
}

/// An NVML call past its deadline that had not returned when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedCall {
    /// The NVML function the worker was in: `nvmlInit_v2`, `nvmlDeviceGetMemoryInfo_v2`.
    pub call: String,
    /// The GPU it was about (PCI address, or `nvml:<index>` before the address was read).
    pub gpu: Option<String>,
    /// When the call was made.
    pub since: Timestamp,
    /// How long it had been blocked when the snapshot was taken.
    pub blocked_ms: u64,
    /// The deadline it passed.
    pub deadline_ms: u64,
}

impl BlockedCall {
    /// `nvmlDeviceGetMemoryInfo_v2 (GPU 0000:1b:00.0) has not returned for 42 s`.
    pub fn describe(&self) -> String {
        let on = self.gpu.as_deref().map(|g| format!(" (GPU {g})")).unwrap_or_default();
        format!("{}{on} has not returned for {} s", self.call, whole_seconds(self.blocked_ms))
    }
}

/// Milliseconds as whole seconds, to the nearest: a call abandoned at a 3 s deadline has been
/// blocked for "3 s", not "2 s", when its wait ended a millisecond early.
pub fn whole_seconds(ms: u64) -> u64 {
    ms.saturating_add(500) / 1000
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlFailure {
    pub kind: NvmlFailureKind,
    pub library: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NvmlInfo {
    pub library: String,
    pub driver_version: Nv<String>,
    pub nvml_version: Nv<String>,
    /// `nvmlSystemGetCudaDriverVersion_v2`: 12040 for CUDA 12.4.
    pub cuda_driver_version: Nv<i32>,
    pub devices: Vec<NvmlGpu>,
    /// Xid events NVML delivered while the snapshot was taken.
    pub xid_events: Vec<NvmlXid>,
    /// Why the event set could not be used, if it could not.
    pub events_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlXid {
    /// `0000:09:00.0`, or the NVML index when the bus id was not readable.
    pub gpu: String,
    pub xid: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryInfo {
    pub total_bytes: u64,
    /// Allocated memory. With NVML's v2 memory info this excludes `reserved_bytes`.
    pub used_bytes: u64,
    /// Unallocated memory as NVML counts it: `total - reserved - used` on a real driver
    /// (see `collect::nvml`), so never computed here from the other two.
    #[serde(default)]
    pub free_bytes: u64,
    /// Memory the driver and firmware set aside (v2 memory info); 0 for BAR1.
    #[serde(default)]
    pub reserved_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurrentPending {
    pub current: bool,
    pub pending: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccCounts {
    pub corrected: u64,
    pub uncorrected: u64,
}

/// The reasons of `nvmlDeviceGetViolationStatus`, as the snapshot names them, in the order of
/// nvml.h's `nvmlPerfPolicyType_t` (power 0 … reliability 5, total app clocks 10, total base
/// clocks 11). DCGM serves the first six as `DCGM_FI_DEV_*_VIOLATION`, fields 240-245
/// (dcgm_fields.h, "time in ns"; `serve::metrics::dcgm`).
pub const VIOLATION_REASONS: &[&str] = &[
    "power",
    "thermal",
    "sync_boost",
    "board_limit",
    "low_utilization",
    "reliability",
    "total_app_clocks",
    "total_base_clocks",
];

/// One memory location's ECC counts (`nvmlDeviceGetMemoryErrorCounter`): since the last reset
/// and over the GPU's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccLocation {
    pub volatile: EccCounts,
    pub aggregate: EccCounts,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: bool,
    pub failure: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvPcie {
    pub gen_current: Nv<u32>,
    pub gen_max: Nv<u32>,
    pub width_current: Nv<u32>,
    pub width_max: Nv<u32>,
    pub replay_counter: Nv<u32>,
}

/// A GPU's clocks and why they are held down, read at one moment (beside a probe's figure).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conditions {
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    /// Names of the active clocks-event (throttle) reasons.
    pub throttle_reasons: Option<Vec<String>>,
    /// ECC errors since the driver loaded (volatile counters), for a rise across a probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_volatile: Option<EccCounts>,
    /// Rows remapped so far, for a rise across a probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remapped_rows: Option<RemappedRows>,
    /// The compute processes NVML lists on the GPU at this reading, the reader's own among them:
    /// for the probes' look for another process (`probe::observed`), not kept in a report.
    #[serde(skip)]
    pub processes: Option<Vec<ProcessInfo>>,
    /// NVML's utilisation of the GPU at this reading (percent of its last sample period), for
    /// the same look; not kept in a report.
    #[serde(skip)]
    pub utilization_gpu: Option<u32>,
}

impl Conditions {
    /// The reasons that hold a GPU below its clocks under load (not idle, not the application
    /// clock setting): thermal, power and hardware slowdowns.
    pub fn held_back(&self) -> Vec<&str> {
        self.throttle_reasons
            .iter()
            .flatten()
            .map(String::as_str)
            .filter(|r| {
                !matches!(*r, "gpu_idle" | "applications_clocks_setting" | "sync_boost" | "display_clock_setting")
            })
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLinkInfo {
    pub link: u32,
    pub active: Nv<bool>,
    /// PCI address of what the link connects to (an NVSwitch on an HGX, another GPU on a
    /// bridged pair; `nvmlDeviceGetNvLinkRemotePciInfo_v2`).
    #[serde(default)]
    pub remote_pci: Nv<String>,
    pub replay_errors: Nv<u64>,
    pub recovery_errors: Nv<u64>,
    pub crc_flit_errors: Nv<u64>,
    pub crc_data_errors: Nv<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FabricState {
    NotSupported,
    NotStarted,
    InProgress,
    Completed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricInfo {
    pub state: FabricState,
    /// The NVML return code name of the fabric's status (`NVML_SUCCESS` when healthy).
    pub status: String,
    pub clique_id: u32,
    pub cluster_uuid: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: u32,
    pub used_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Utilization {
    pub gpu: u32,
    pub memory: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NvmlGpu {
    pub index: u32,
    /// `0000:09:00.0` (NVML's 8-digit domain shortened to sysfs form).
    pub pci_address: Nv<String>,
    pub pci_device_id: Nv<u32>,
    pub name: Nv<String>,
    pub uuid: Nv<String>,
    pub serial: Nv<String>,
    pub board_part_number: Nv<String>,
    pub vbios_version: Nv<String>,
    pub inforom_image_version: Nv<String>,
    /// Which module of the baseboard the GPU is (`nvmlDeviceGetModuleId`: "a unique identifier
    /// for each GPU module that exists on a given baseboard", 0 for a card that is not on one —
    /// NVML API reference, Device Queries). An HGX slot, not the VM's index.
    #[serde(default)]
    pub module_id: Nv<u32>,
    pub inforom_valid: Nv<bool>,
    pub memory: Nv<MemoryInfo>,
    pub bar1: Nv<MemoryInfo>,
    pub temperature_c: Nv<u32>,
    pub slowdown_temperature_c: Nv<u32>,
    pub shutdown_temperature_c: Nv<u32>,
    pub power_usage_mw: Nv<u32>,
    pub power_limit_mw: Nv<u32>,
    pub default_power_limit_mw: Nv<u32>,
    pub sm_clock_mhz: Nv<u32>,
    pub mem_clock_mhz: Nv<u32>,
    /// Names of the active clocks-event (throttle) reasons.
    pub throttle_reasons: Nv<Vec<String>>,
    pub ecc_mode: Nv<CurrentPending>,
    pub ecc_volatile: Nv<EccCounts>,
    pub ecc_aggregate: Nv<EccCounts>,
    /// How long NVML has held the clocks back, per reason, since the driver loaded, in ns
    /// (`nvmlDeviceGetViolationStatus`; keys `VIOLATION_REASONS`). Reasons the GPU does not
    /// count are left out; none at all is `NotSupported`.
    #[serde(default)]
    pub violations_ns: Nv<std::collections::BTreeMap<String, u64>>,
    /// On-die SRAM apart from the HBM (DRAM): row remapping heals HBM only.
    #[serde(default)]
    pub ecc_sram: Nv<EccLocation>,
    #[serde(default)]
    pub ecc_dram: Nv<EccLocation>,
    pub remapped_rows: Nv<RemappedRows>,
    pub persistence_mode: Nv<bool>,
    pub mig_mode: Nv<CurrentPending>,
    pub pcie: NvPcie,
    pub nvlinks: Nv<Vec<NvLinkInfo>>,
    pub fabric: Nv<FabricInfo>,
    pub processes: Nv<Vec<ProcessInfo>>,
    pub utilization: Nv<Utilization>,
    /// HBM temperature (NVML field `NVML_FI_DEV_MEMORY_TEMP`).
    #[serde(default)]
    pub memory_temperature_c: Nv<u32>,
    /// Energy since the driver was loaded, in millijoules (`nvmlDeviceGetTotalEnergyConsumption`).
    #[serde(default)]
    pub energy_mj: Nv<u64>,
    /// Percent of NVML's sample period the video encoders / decoders were busy.
    #[serde(default)]
    pub encoder_utilization: Nv<u32>,
    #[serde(default)]
    pub decoder_utilization: Nv<u32>,
    /// NVLink data sent and received over all links, in KiB, since the driver loaded.
    #[serde(default)]
    pub nvlink_throughput: Nv<NvLinkThroughput>,
    /// The GPUs (PCI addresses) NVML says this one reaches peer-to-peer over NVLink
    /// (`nvmlDeviceGetP2PStatus` with `NVML_P2P_CAPS_INDEX_NVLINK` answering OK).
    #[serde(default)]
    pub nvlink_p2p: Nv<Vec<String>>,
    /// What NVML says the GPU needs to recover (field `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, the
    /// raw `nvmlDeviceGpuRecoveryAction_t`: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P,
    /// 4 drain and reset; nvml.h). Drivers before the field existed answer not supported.
    #[serde(default)]
    pub recovery_action: Nv<u32>,
    /// Profiling metrics from NVML's GPM over two samples (Hopper and later), in DCGM's units.
    #[serde(default)]
    pub gpm: Nv<Gpm>,
}

/// NVML GPM metrics over the interval between two samples, converted as DCGM converts them for
/// its `DCGM_FI_PROF_*` fields (`DcgmGpmManager.cpp`: a percentage ÷ 100 is an activity ratio;
/// `DcgmCacheManager.cpp`: PCIe and NVLink rates come in MiB/s and are served in bytes/s), by
/// DCGM's field name. A metric the GPU gave as NaN is left out, never 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Gpm {
    pub interval_ms: u64,
    pub values: std::collections::BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLinkThroughput {
    pub tx_kib: u64,
    pub rx_kib: u64,
}
