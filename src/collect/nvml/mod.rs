//! NVML, loaded at run time (nvml-wrapper over libloading): never linked, so the agent starts and
//! reports on a machine with no driver at all.
//!
//! Every reading is an `Nv<T>`: a value, `NotSupported` (common inside VMs), or the error NVML
//! gave. Two calls nvml-wrapper does not wrap (remapped rows, fabric info) go through
//! nvml-wrapper-sys on a second handle to the same library.
//!
//! `session` keeps the handle and runs every call under a deadline; this file reads what NVML
//! says and turns it into the snapshot's types.

use super::deadline::Tracker;
use crate::snapshot::{
    CurrentPending, EccCounts, EccLocation, FabricInfo, FabricState, MemoryInfo, Nv, NvLinkInfo, NvLinkThroughput,
    NvPcie, NvmlFailure, NvmlFailureKind, NvmlGpu, NvmlXid, ProcessInfo, RemappedRows, Utilization,
};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, MemoryLocation, TemperatureSensor, TemperatureThreshold,
};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::{Device, EventSet, Nvml};
use nvml_wrapper_sys::bindings::{nvmlFieldValue_t, nvmlGpuFabricInfo_t, nvmlReturn_t, NvmlLib};
use std::sync::Arc;

/// `ask!(tracker, "nvmlDeviceGetName", d.name())`: notes the function the worker is about to
/// call, then calls it, so a call that never returns is named (`collect::deadline`, rule 2).
macro_rules! ask {
    ($t:expr, $function:literal, $call:expr) => {{
        $t.at($function);
        $call
    }};
}

/// The soname the driver installs; what `dlopen` finds on a machine with the driver.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML has at most this many NVLinks per GPU (NVML_NVLINK_MAX_LINKS; 18 on H100 SXM5).
const MAX_NVLINKS: u32 = 18;

/// At most this many Xid events are drained in one snapshot, so a storm cannot hold it up.
const MAX_EVENTS_PER_SNAPSHOT: usize = 1024;

mod session;
pub use session::{read, Deadlines, Reading, Session};

/// Tells apart the init failures a person fixes differently.
pub fn classify_init_error(library: &str, e: &NvmlError) -> NvmlFailure {
    let kind = match e {
        NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => NvmlFailureKind::LibraryNotFound,
        NvmlError::DriverNotLoaded => NvmlFailureKind::DriverNotLoaded,
        NvmlError::LibRmVersionMismatch => NvmlFailureKind::VersionMismatch,
        NvmlError::NoPermission => NvmlFailureKind::NoPermission,
        _ => NvmlFailureKind::Other,
    };
    let message = match e {
        NvmlError::LibloadingError(inner) => format!("cannot load {library}: {inner}"),
        other => format!("nvmlInit_v2: {other}"),
    };
    NvmlFailure { kind, library: library.into(), message }
}

fn nv<T>(r: Result<T, NvmlError>) -> Nv<T> {
    match r {
        Ok(v) => Nv::Value(v),
        // A function the loaded NVML lacks is, for the reader, a function it does not support.
        Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => Nv::NotSupported,
        Err(e) => Nv::Error(e.to_string()),
    }
}

fn unreadable_device(index: u32, e: &NvmlError) -> NvmlGpu {
    unreadable(index, format!("nvmlDeviceGetHandleByIndex({index}): {e}"), None)
}

/// A GPU with no reading, each field saying `why`; named by `address` when that is known (a GPU
/// whose call blocked keeps the address an earlier reading gave), so its findings say which.
fn unreadable(index: u32, why: String, address: Option<String>) -> NvmlGpu {
    let why: Nv<()> = Nv::Error(why);
    macro_rules! err {
        () => {
            why.without_value()
        };
    }
    NvmlGpu {
        index,
        pci_address: address.map(Nv::Value).unwrap_or_else(|| why.without_value()),
        pci_device_id: err!(),
        name: err!(),
        uuid: err!(),
        serial: err!(),
        board_part_number: err!(),
        vbios_version: err!(),
        inforom_image_version: err!(),
        module_id: err!(),
        inforom_valid: err!(),
        memory: err!(),
        bar1: err!(),
        temperature_c: err!(),
        slowdown_temperature_c: err!(),
        shutdown_temperature_c: err!(),
        power_usage_mw: err!(),
        power_limit_mw: err!(),
        default_power_limit_mw: err!(),
        sm_clock_mhz: err!(),
        mem_clock_mhz: err!(),
        throttle_reasons: err!(),
        ecc_mode: err!(),
        ecc_volatile: err!(),
        ecc_aggregate: err!(),
        violations_ns: err!(),
        ecc_sram: err!(),
        ecc_dram: err!(),
        remapped_rows: err!(),
        persistence_mode: err!(),
        mig_mode: err!(),
        pcie: NvPcie {
            gen_current: err!(),
            gen_max: err!(),
            width_current: err!(),
            width_max: err!(),
            replay_counter: err!(),
        },
        nvlinks: err!(),
        fabric: err!(),
        processes: err!(),
        utilization: err!(),
        memory_temperature_c: err!(),
        energy_mj: err!(),
        encoder_utilization: err!(),
        decoder_utilization: err!(),
        nvlink_throughput: err!(),
        nvlink_p2p: err!(),
        recovery_action: err!(),
        gpm: err!(),
    }
}

/// Everything NVML says about one GPU, call by call in a fixed order, each named to the tracker
/// before it is made (`ask!`). The peer matrix and GPM are read for all GPUs together later.
fn read_device(index: u32, d: &Device, sys: Option<&NvmlLib>, t: &Tracker) -> NvmlGpu {
    let (pci_address, pci_device_id) = pci_identity(d, t);
    if let Nv::Value(a) = &pci_address {
        t.set_address(a);
    }
    let ecc = |counter| ecc_counts(d, t, counter);
    let Fields { memory_temperature_c, nvlink_throughput, recovery_action } =
        sys.map(|s| ask!(t, "nvmlDeviceGetFieldValues", field_values(s, d))).unwrap_or_default();
    NvmlGpu {
        index,
        pci_address,
        pci_device_id,
        name: ask!(t, "nvmlDeviceGetName", nv(d.name())),
        uuid: ask!(t, "nvmlDeviceGetUUID", nv(d.uuid())),
        serial: ask!(t, "nvmlDeviceGetSerial", nv(d.serial())),
        board_part_number: ask!(t, "nvmlDeviceGetBoardPartNumber", nv(d.board_part_number())),
        vbios_version: ask!(t, "nvmlDeviceGetVbiosVersion", nv(d.vbios_version())),
        inforom_image_version: ask!(t, "nvmlDeviceGetInforomImageVersion", nv(d.info_rom_image_version())),
        module_id: sys.map(|s| ask!(t, "nvmlDeviceGetModuleId", module_id(s, d))).unwrap_or(Nv::NotSupported),
        inforom_valid: match ask!(t, "nvmlDeviceValidateInforom", d.validate_info_rom()) {
            Ok(()) => Nv::Value(true),
            Err(NvmlError::CorruptedInfoROM) => Nv::Value(false),
            Err(e) => nv::<bool>(Err(e)),
        },
        // v2 memory info: `used` leaves out what the driver reserves, and `free` is what is
        // left after both, so all four are taken as NVML gives them.
        memory: ask!(
            t,
            "nvmlDeviceGetMemoryInfo_v2",
            nv(d.memory_info().map(|m| MemoryInfo {
                total_bytes: m.total,
                used_bytes: m.used,
                free_bytes: m.free,
                reserved_bytes: m.reserved,
            }))
        ),
        bar1: ask!(
            t,
            "nvmlDeviceGetBAR1MemoryInfo",
            nv(d.bar1_memory_info().map(|m| MemoryInfo {
                total_bytes: m.total,
                used_bytes: m.used,
                free_bytes: m.free,
                reserved_bytes: 0,
            }))
        ),
        temperature_c: ask!(t, "nvmlDeviceGetTemperature", nv(d.temperature(TemperatureSensor::Gpu))),
        slowdown_temperature_c: ask!(
            t,
            "nvmlDeviceGetTemperatureThreshold",
            nv(d.temperature_threshold(TemperatureThreshold::Slowdown))
        ),
        shutdown_temperature_c: ask!(
            t,
            "nvmlDeviceGetTemperatureThreshold",
            nv(d.temperature_threshold(TemperatureThreshold::Shutdown))
        ),
        power_usage_mw: ask!(t, "nvmlDeviceGetPowerUsage", nv(d.power_usage())),
        power_limit_mw: ask!(t, "nvmlDeviceGetEnforcedPowerLimit", nv(d.enforced_power_limit())),
        default_power_limit_mw: ask!(
            t,
            "nvmlDeviceGetPowerManagementDefaultLimit",
            nv(d.power_management_limit_default())
        ),
        sm_clock_mhz: ask!(t, "nvmlDeviceGetClockInfo", nv(d.clock_info(Clock::SM))),
        mem_clock_mhz: ask!(t, "nvmlDeviceGetClockInfo", nv(d.clock_info(Clock::Memory))),
        throttle_reasons: ask!(
            t,
            "nvmlDeviceGetCurrentClocksEventReasons",
            nv(d.current_throttle_reasons().map(|r| throttle_names(r.bits())))
        ),
        ecc_mode: ask!(
            t,
            "nvmlDeviceGetEccMode",
            nv(d.is_ecc_enabled().map(|m| CurrentPending { current: m.currently_enabled, pending: m.pending_enabled }))
        ),
        ecc_volatile: ecc(EccCounter::Volatile),
        ecc_aggregate: ecc(EccCounter::Aggregate),
        violations_ns: violations(d, t),
        ecc_sram: ecc_at(d, t, MemoryLocation::SRAM),
        ecc_dram: ecc_at(d, t, MemoryLocation::Device),
        remapped_rows: sys.map(|s| remapped_rows(s, d, t)).unwrap_or(Nv::NotSupported),
        persistence_mode: ask!(t, "nvmlDeviceGetPersistenceMode", nv(d.is_in_persistent_mode())),
        mig_mode: ask!(
            t,
            "nvmlDeviceGetMigMode",
            nv(d.mig_mode().map(|m| CurrentPending { current: m.current != 0, pending: m.pending != 0 }))
        ),
        pcie: NvPcie {
            gen_current: ask!(t, "nvmlDeviceGetCurrPcieLinkGeneration", nv(d.current_pcie_link_gen())),
            gen_max: ask!(t, "nvmlDeviceGetMaxPcieLinkGeneration", nv(d.max_pcie_link_gen())),
            width_current: ask!(t, "nvmlDeviceGetCurrPcieLinkWidth", nv(d.current_pcie_link_width())),
            width_max: ask!(t, "nvmlDeviceGetMaxPcieLinkWidth", nv(d.max_pcie_link_width())),
            replay_counter: ask!(t, "nvmlDeviceGetPcieReplayCounter", nv(d.pcie_replay_counter())),
        },
        nvlinks: read_nvlinks(d, t),
        nvlink_p2p: Nv::NotSupported, // per pair: filled in by nvlink_p2p once every GPU is read
        fabric: sys.map(|s| ask!(t, "nvmlDeviceGetGpuFabricInfo", fabric_info(s, d))).unwrap_or(Nv::NotSupported),
        processes: compute_processes(d, t),
        utilization: ask!(
            t,
            "nvmlDeviceGetUtilizationRates",
            nv(d.utilization_rates().map(|u| Utilization { gpu: u.gpu, memory: u.memory }))
        ),
        memory_temperature_c,
        energy_mj: ask!(t, "nvmlDeviceGetTotalEnergyConsumption", nv(d.total_energy_consumption())),
        encoder_utilization: ask!(
            t,
            "nvmlDeviceGetEncoderUtilization",
            nv(d.encoder_utilization().map(|u| u.utilization))
        ),
        decoder_utilization: ask!(
            t,
            "nvmlDeviceGetDecoderUtilization",
            nv(d.decoder_utilization().map(|u| u.utilization))
        ),
        nvlink_throughput,
        recovery_action,
        // Read for every GPU together, between two samples (`gpm`).
        gpm: Nv::NotSupported,
    }
}

/// The GPU's PCI address (sysfs form) and device id.
fn pci_identity(d: &Device, t: &Tracker) -> (Nv<String>, Nv<u32>) {
    match ask!(t, "nvmlDeviceGetPciInfo_v3", d.pci_info()) {
        Ok(p) => (
            normalize_bus_id(&p.bus_id)
                .map(Nv::Value)
                .unwrap_or_else(|| Nv::Error(format!("unexpected bus id {:?}", p.bus_id))),
            Nv::Value(p.pci_device_id),
        ),
        Err(e) => {
            let why = nv::<()>(Err(e));
            (why.without_value(), why.without_value())
        }
    }
}

/// Corrected and uncorrected ECC errors, since the last reset (volatile) or over the GPU's life
/// (aggregate).
fn ecc_counts(d: &Device, t: &Tracker, counter: EccCounter) -> Nv<EccCounts> {
    t.at("nvmlDeviceGetTotalEccErrors");
    match (d.total_ecc_errors(MemoryError::Corrected, counter), d.total_ecc_errors(MemoryError::Uncorrected, counter)) {
        (Ok(corrected), Ok(uncorrected)) => Nv::Value(EccCounts { corrected, uncorrected }),
        (Err(e), _) | (_, Err(e)) => nv::<EccCounts>(Err(e)),
    }
}

/// `nvmlDeviceGetViolationStatus` for each reason: a reason the GPU does not count is left out;
/// another error, or none counted, is the reading's.
fn violations(d: &Device, t: &Tracker) -> Nv<std::collections::BTreeMap<String, u64>> {
    use nvml_wrapper::enum_wrappers::device::PerformancePolicy as P;
    t.at("nvmlDeviceGetViolationStatus");
    let policies = [
        P::Power,
        P::Thermal,
        P::SyncBoost,
        P::BoardLimit,
        P::LowUtilization,
        P::Reliability,
        P::TotalAppClocks,
        P::TotalBaseClocks,
    ];
    let mut out = std::collections::BTreeMap::new();
    for (policy, name) in policies.into_iter().zip(crate::snapshot::VIOLATION_REASONS) {
        match d.violation_status(policy) {
            Ok(v) => {
                out.insert(name.to_string(), v.violation_time);
            }
            Err(NvmlError::NotSupported) => {}
            Err(e) => return nv(Err(e)),
        }
    }
    if out.is_empty() {
        return Nv::NotSupported;
    }
    Nv::Value(out)
}

/// One memory location's four counts (`nvmlDeviceGetMemoryErrorCounter`); the first error stops.
fn ecc_at(d: &Device, t: &Tracker, location: MemoryLocation) -> Nv<EccLocation> {
    t.at("nvmlDeviceGetMemoryErrorCounter");
    let count = |e, c| d.memory_error_counter(e, c, location);
    let counts = |c: EccCounter| -> Result<EccCounts, NvmlError> {
        Ok(EccCounts { corrected: count(MemoryError::Corrected, c)?, uncorrected: count(MemoryError::Uncorrected, c)? })
    };
    nv(counts(EccCounter::Volatile)
        .and_then(|volatile| Ok(EccLocation { volatile, aggregate: counts(EccCounter::Aggregate)? })))
}

/// The compute processes on the GPU, with the memory each holds where NVML can say.
pub(super) fn compute_processes(d: &Device, t: &Tracker) -> Nv<Vec<ProcessInfo>> {
    ask!(
        t,
        "nvmlDeviceGetComputeRunningProcesses_v3",
        nv(d.running_compute_processes().map(|ps| {
            ps.into_iter()
                .map(|p| ProcessInfo {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect()
        }))
    )
}

/// NVML field ids (nvml.h, "Field Identifiers") the agent reads with `nvmlDeviceGetFieldValues`.
const FI_DEV_MEMORY_TEMP: u32 = 82;
const FI_DEV_NVLINK_THROUGHPUT_DATA_TX: u32 = 138;
const FI_DEV_NVLINK_THROUGHPUT_DATA_RX: u32 = 139;
/// "GPU Recovery action - None/Reset/Reboot/Drain P2P/Drain and Reset" (nvml.h, NVIDIA/go-nvml
/// `gen/nvml/nvml.h`), the field that replaces the deprecated 226/227 reset-status fields.
const FI_DEV_GET_GPU_RECOVERY_ACTION: u32 = 230;
/// The `scopeId` that asks for a throughput counter summed over all links (nvml.h: "A scopeId
/// of UINT_MAX returns aggregate value summed up across all links"); 0 would be link 0 alone.
const ALL_LINKS: u32 = u32::MAX;

/// The readings taken through `nvmlDeviceGetFieldValues`; each not supported when the call is not.
#[derive(Default)]
struct Fields {
    memory_temperature_c: Nv<u32>,
    nvlink_throughput: Nv<NvLinkThroughput>,
    recovery_action: Nv<u32>,
}

/// HBM temperature, NVLink data throughput and the recovery action, in one
/// `nvmlDeviceGetFieldValues` call (each field carries its own return code, so a field an older
/// driver lacks does not cost the others).
fn field_values(sys: &NvmlLib, d: &Device) -> Fields {
    let Ok(f) = sys.nvmlDeviceGetFieldValues.as_ref() else { return Fields::default() };
    let ask = [
        (FI_DEV_MEMORY_TEMP, 0),
        (FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
        (FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        (FI_DEV_GET_GPU_RECOVERY_ACTION, 0),
    ];
    let mut values: Vec<nvmlFieldValue_t> = ask
        .iter()
        .map(|&(field, scope)| {
            // SAFETY: nvmlFieldValue_t is plain C data (integers and a union of numbers), for
            // which all-zero bytes are a valid value.
            let mut v: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
            v.fieldId = field;
            v.scopeId = scope;
            v
        })
        .collect();
    // SAFETY: a live device handle, and `values` holds exactly the count passed, each entry
    // initialised; NVML writes only into those entries.
    let r = unsafe { f(d.handle(), values.len() as i32, values.as_mut_ptr()) };
    if let Err(e) = ret(r) {
        let why = nv::<()>(Err(e));
        return Fields {
            memory_temperature_c: why.without_value(),
            nvlink_throughput: why.without_value(),
            recovery_action: why.without_value(),
        };
    }
    let small = |v: Nv<u64>, what: &str| match v {
        Nv::Value(t) => u32::try_from(t).map(Nv::Value).unwrap_or_else(|_| Nv::Error(format!("{what} {t}"))),
        other => other.without_value(),
    };
    let nvlink_throughput = match (field_u64(&values[1]), field_u64(&values[2])) {
        (Nv::Value(tx_kib), Nv::Value(rx_kib)) => Nv::Value(NvLinkThroughput { tx_kib, rx_kib }),
        (Nv::Value(_), other) | (other, _) => other.without_value(),
    };
    Fields {
        memory_temperature_c: small(field_u64(&values[0]), "memory temperature"),
        nvlink_throughput,
        recovery_action: small(field_u64(&values[3]), "recovery action"),
    }
}

/// One field's value as an unsigned integer, read from the union member its `valueType` names
/// (nvml.h `nvmlValueType_t`), or the field's own error.
fn field_u64(v: &nvmlFieldValue_t) -> Nv<u64> {
    if let Err(e) = ret(v.nvmlReturn) {
        return nv(Err(e));
    }
    // SAFETY: NVML wrote the union member `valueType` names; each arm reads only that member.
    let (signed, unsigned) = unsafe {
        match v.valueType {
            0 => {
                let x = v.value.dVal;
                (None, (x.is_finite() && x >= 0.0).then_some(x.round() as u64))
            }
            1 => (None, Some(u64::from(v.value.uiVal))),
            2 => (None, Some(v.value.ulVal)),
            3 => (None, Some(v.value.ullVal)),
            4 => (Some(v.value.sllVal), None),
            5 => (Some(i64::from(v.value.siVal)), None),
            6 => (None, Some(u64::from(v.value.usVal))),
            other => return Nv::Error(format!("field {}: unknown value type {other}", v.fieldId)),
        }
    };
    match (signed, unsigned) {
        (_, Some(u)) => Nv::Value(u),
        (Some(s), None) => u64::try_from(s)
            .map(Nv::Value)
            .unwrap_or_else(|_| Nv::Error(format!("field {}: negative value {s}", v.fieldId))),
        (None, None) => Nv::Error(format!("field {}: not a number", v.fieldId)),
    }
}

/// The GPM metrics read, with DCGM's field name for each and whether NVML gives it as a
/// percentage (÷ 100: an activity ratio) or in MiB/s (× 1,048,576: bytes/s) — DCGM's own map
/// from field to metric (`DcgmFieldIdToNvmlGpmMetricId`, dcgm_fields.cpp) and conversions
/// (`DcgmGpmManager.cpp`, `DcgmCacheManager.cpp`: "PCIe, NVLink, and C2C throughput fields are
/// returned in MiB/s by NVML").
pub const GPM_FIELDS: &[(&str, nvml_wrapper::enums::gpm::GpmMetricId, GpmUnit)] = {
    use nvml_wrapper::enums::gpm::GpmMetricId as M;
    &[
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", M::GraphicsUtil, GpmUnit::Percent),
        ("DCGM_FI_PROF_SM_ACTIVE", M::SmUtil, GpmUnit::Percent),
        ("DCGM_FI_PROF_SM_OCCUPANCY", M::SmOccupancy, GpmUnit::Percent),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", M::AnyTensorUtil, GpmUnit::Percent),
        ("DCGM_FI_PROF_DRAM_ACTIVE", M::DramBwUtil, GpmUnit::Percent),
        ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", M::Fp64Util, GpmUnit::Percent),
        ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", M::Fp32Util, GpmUnit::Percent),
        ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", M::Fp16Util, GpmUnit::Percent),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", M::PcieTxPerSec, GpmUnit::MibPerSecond),
        ("DCGM_FI_PROF_PCIE_RX_BYTES", M::PcieRxPerSec, GpmUnit::MibPerSecond),
        ("DCGM_FI_PROF_NVLINK_TX_BYTES", M::NvlinkTotalTxPerSec, GpmUnit::MibPerSecond),
        ("DCGM_FI_PROF_NVLINK_RX_BYTES", M::NvlinkTotalRxPerSec, GpmUnit::MibPerSecond),
    ]
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpmUnit {
    Percent,
    MibPerSecond,
}

/// Time between a GPM metric's two samples: NVML computes each metric over the interval
/// between two samples; a tenth of a second keeps a snapshot quick and the ratio meaningful.
pub const GPM_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// GPM metrics of the GPUs in `gpus` (index, PCI address): every GPU that has GPM sampled, one
/// pause of `GPM_INTERVAL` for all, sampled again, each metric computed between the two. A GPU
/// without GPM (`nvmlGpmQueryDeviceSupport`: not Hopper, or not in this driver) gets
/// `NotSupported`.
fn gpm(nvml: &Nvml, gpus: &[(u32, String)], t: &Tracker) -> Vec<(u32, Nv<crate::snapshot::Gpm>)> {
    let mut first = Vec::new();
    let mut out = Vec::new();
    for (i, _) in gpus {
        let d = match ask!(t, "nvmlDeviceGetHandleByIndex_v2", nvml.device_by_index(*i)) {
            Ok(d) => d,
            Err(e) => {
                out.push((*i, nv(Err(e))));
                continue;
            }
        };
        match ask!(t, "nvmlGpmQueryDeviceSupport", d.gpm_support()) {
            Ok(true) => match ask!(t, "nvmlGpmSampleGet", d.gpm_sample()) {
                Ok(s) => first.push((*i, d, s, std::time::Instant::now())),
                Err(e) => out.push((*i, nv(Err(e)))),
            },
            Ok(false) => out.push((*i, Nv::NotSupported)),
            Err(e) => out.push((*i, nv(Err(e)))),
        }
    }
    if !first.is_empty() {
        std::thread::sleep(GPM_INTERVAL);
    }
    let ids: Vec<_> = GPM_FIELDS.iter().map(|(_, id, _)| *id).collect();
    for (i, d, s1, t1) in first {
        let s2 = match ask!(t, "nvmlGpmSampleGet", d.gpm_sample()) {
            Ok(s) => s,
            Err(e) => {
                out.push((i, nv(Err(e))));
                continue;
            }
        };
        let interval_ms = t1.elapsed().as_millis() as u64;
        match ask!(t, "nvmlGpmMetricsGet", nvml_wrapper::gpm::gpm_metrics_get(nvml, &s1, &s2, &ids)) {
            Ok(results) => {
                let mut values = std::collections::BTreeMap::new();
                for ((name, _, unit), r) in GPM_FIELDS.iter().zip(results) {
                    let Ok(m) = r else { continue };
                    // A NaN (or infinite) reading is left out, never served as a number.
                    if !m.value.is_finite() {
                        continue;
                    }
                    let v = match unit {
                        GpmUnit::Percent => m.value / 100.0,
                        GpmUnit::MibPerSecond => m.value * 1_048_576.0,
                    };
                    values.insert((*name).to_string(), v);
                }
                out.push((i, Nv::Value(crate::snapshot::Gpm { interval_ms, values })));
            }
            Err(e) => out.push((i, nv(Err(e)))),
        }
    }
    out
}

/// Which GPUs each GPU reaches over NVLink, as NVML says (`nvmlDeviceGetP2PStatus`, NVLink
/// capability), for the GPUs in `gpus` (index, PCI address). NVML answers per pair; a GPU for
/// which every pair failed to answer keeps that error, one with no NVLink peer gets an empty list.
fn nvlink_p2p(nvml: &Nvml, gpus: &[(u32, String)], t: &Tracker) -> Vec<(u32, Nv<Vec<String>>)> {
    use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
    let devices: Vec<(u32, Option<Device>, &String)> = gpus
        .iter()
        .map(|(i, a)| (*i, ask!(t, "nvmlDeviceGetHandleByIndex_v2", nvml.device_by_index(*i)).ok(), a))
        .collect();
    let mut found = Vec::with_capacity(devices.len());
    for (i, a, _) in &devices {
        let Some(a) = a else {
            found.push((*i, Nv::NotSupported));
            continue;
        };
        let (mut peers, mut error, mut answered) = (Vec::new(), None, false);
        for (j, b, addr) in &devices {
            let Some(b) = b else { continue };
            if i == j {
                continue;
            }
            match ask!(t, "nvmlDeviceGetP2PStatus", a.p2p_status(b, P2pCapabilitiesIndex::NvLink)) {
                Ok(P2pStatus::Ok) => {
                    answered = true;
                    peers.push((*addr).clone());
                }
                Ok(_) => answered = true,
                Err(e) => error = Some(nv::<Vec<String>>(Err(e))),
            }
        }
        found.push((
            *i,
            match (answered, error) {
                (false, Some(e)) => e,
                _ => Nv::Value(peers),
            },
        ));
    }
    found
}

fn read_nvlinks(d: &Device, t: &Tracker) -> Nv<Vec<NvLinkInfo>> {
    let mut links = Vec::new();
    for link in 0..MAX_NVLINKS {
        let w = d.link_wrapper_for(link);
        let active = match ask!(t, "nvmlDeviceGetNvLinkState", w.is_active()) {
            Ok(a) => Nv::Value(a),
            // Past the last link NVML answers "invalid argument": the list is complete.
            Err(NvmlError::InvalidArg) => break,
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) if link == 0 => {
                return Nv::NotSupported
            }
            Err(e) => nv::<bool>(Err(e)),
        };
        links.push(NvLinkInfo {
            link,
            active,
            remote_pci: match ask!(t, "nvmlDeviceGetNvLinkRemotePciInfo_v2", w.remote_pci_info()) {
                Ok(p) => normalize_bus_id(&p.bus_id)
                    .map(Nv::Value)
                    .unwrap_or_else(|| Nv::Error(format!("unexpected bus id {:?}", p.bus_id))),
                Err(e) => nv::<String>(Err(e)),
            },
            replay_errors: ask!(t, "nvmlDeviceGetNvLinkErrorCounter", nv(w.error_counter(ErrorCounter::DlReplay))),
            recovery_errors: nv(w.error_counter(ErrorCounter::DlRecovery)),
            crc_flit_errors: nv(w.error_counter(ErrorCounter::DlCrcFlit)),
            crc_data_errors: nv(w.error_counter(ErrorCounter::DlCrcData)),
        });
    }
    Nv::Value(links)
}

/// `nvmlReturn_t` → the error nvml-wrapper would make of it (`Ok` for success).
fn ret(code: nvmlReturn_t) -> Result<(), NvmlError> {
    nvml_wrapper::error::nvml_try(code)
}

fn remapped_rows(sys: &NvmlLib, d: &Device, t: &Tracker) -> Nv<RemappedRows> {
    let Ok(f) = sys.nvmlDeviceGetRemappedRows.as_ref() else { return Nv::NotSupported };
    t.at("nvmlDeviceGetRemappedRows");
    let (mut corr, mut unc, mut pending, mut failure) = (0, 0, 0, 0);
    // SAFETY: `d.handle()` is a live device handle of an initialised NVML; the four out
    // pointers are valid, distinct locals that live across the call.
    let r = unsafe { f(d.handle(), &mut corr, &mut unc, &mut pending, &mut failure) };
    nv(ret(r).map(|()| RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failure: failure != 0,
    }))
}

/// `nvmlDeviceGetModuleId` (not wrapped by nvml-wrapper); a library without the symbol (older
/// than the call) is "not supported", as NVML would answer for a device without it.
fn module_id(sys: &NvmlLib, d: &Device) -> Nv<u32> {
    let Ok(f) = sys.nvmlDeviceGetModuleId.as_ref() else { return Nv::NotSupported };
    let mut id = 0;
    // SAFETY: a live device handle and a valid out pointer to a local that lives across the call.
    let r = unsafe { f(d.handle(), &mut id) };
    nv(ret(r).map(|()| id))
}

fn fabric_info(sys: &NvmlLib, d: &Device) -> Nv<FabricInfo> {
    let Ok(f) = sys.nvmlDeviceGetGpuFabricInfo.as_ref() else { return Nv::NotSupported };
    let mut info = nvmlGpuFabricInfo_t { clusterUuid: [0; 16], status: 0, cliqueId: 0, state: 0 };
    // SAFETY: a live device handle and a valid, initialised out struct of the type the
    // function is declared with.
    let r = unsafe { f(d.handle(), &mut info) };
    nv(ret(r).map(|()| FabricInfo {
        state: fabric_state(info.state as u32),
        status: return_code_name(info.status),
        clique_id: info.cliqueId,
        cluster_uuid: format_uuid(&info.clusterUuid),
    }))
}

/// An event set with every GPU of `only` (all when `None`) that accepts Xid events registered
/// on it, how many did, and the last registration error.
fn xid_event_set<'n>(
    nvml: &'n Nvml,
    only: Option<&[u32]>,
    t: &Tracker,
) -> Result<(EventSet<'n>, usize, Option<String>), String> {
    t.at("nvmlEventSetCreate");
    let mut set = nvml.create_event_set().map_err(|e| format!("nvmlEventSetCreate: {e}"))?;
    let mut registered = 0;
    let mut last_error = None;
    let indices: Vec<u32> = match only {
        Some(o) => o.to_vec(),
        None => (0..ask!(t, "nvmlDeviceGetCount_v2", nvml.device_count()).unwrap_or(0)).collect(),
    };
    for i in indices {
        let Ok(d) = ask!(t, "nvmlDeviceGetHandleByIndex_v2", nvml.device_by_index(i)) else { continue };
        match ask!(t, "nvmlDeviceRegisterEvents", d.register_events(EventTypes::CRITICAL_XID_ERROR, set)) {
            Ok(s) => {
                set = s;
                registered += 1;
            }
            Err(e) => {
                last_error = Some(format!("nvmlDeviceRegisterEvents (GPU {i}): {}", e.error));
                // A failed registration frees the set (nvml-wrapper does so); start a new one.
                t.at("nvmlEventSetCreate");
                set = nvml.create_event_set().map_err(|e| format!("nvmlEventSetCreate: {e}"))?;
            }
        }
    }
    Ok((set, registered, last_error))
}

/// The Xid in an NVML event, with the GPU named by its PCI address.
fn xid_of(ev: &EventData<'_>) -> Option<NvmlXid> {
    let Some(nvml_wrapper::enums::event::XidError::Value(xid)) = ev.event_data.as_ref().cloned() else { return None };
    let gpu = ev
        .device
        .pci_info()
        .ok()
        .and_then(|p| normalize_bus_id(&p.bus_id))
        .unwrap_or_else(|| format!("nvml:{}", ev.device.index().unwrap_or(u32::MAX)));
    Some(NvmlXid { gpu, xid })
}

/// Drains the Xid events NVML has now (`wait(0)`) from the GPUs `only`, without waiting.
fn drain_xid_events(nvml: &Nvml, only: &[u32], t: &Tracker) -> (Vec<NvmlXid>, Option<String>) {
    let (set, registered, mut last_error) = match xid_event_set(nvml, Some(only), t) {
        Ok(v) => v,
        Err(e) => return (Vec::new(), Some(e)),
    };
    if registered == 0 {
        return (Vec::new(), last_error.or_else(|| Some("no GPU accepted Xid events".into())));
    }
    let mut events = Vec::new();
    while events.len() < MAX_EVENTS_PER_SNAPSHOT {
        match ask!(t, "nvmlEventSetWait_v2", set.wait(0)) {
            Ok(ev) => events.extend(xid_of(&ev)),
            Err(NvmlError::Timeout) => break,
            Err(e) => {
                last_error = Some(format!("nvmlEventSetWait: {e}"));
                break;
            }
        }
    }
    (events, last_error)
}

/// `00000000:09:00.0` (NVML) → `0000:09:00.0` (sysfs).
pub fn normalize_bus_id(bus_id: &str) -> Option<String> {
    let b = bus_id.trim().trim_end_matches('\0').to_ascii_lowercase();
    let (domain, rest) = b.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let addr = format!("{domain:04x}:{rest}");
    crate::collect::pci::is_pci_address(&addr).then_some(addr)
}

/// NVML clocks-event reason bits (nvml.h `nvmlClocksEventReason*`) and their names.
pub const THROTTLE_REASONS: &[(u64, &str)] = &[
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

pub fn throttle_names(bits: u64) -> Vec<String> {
    let mut names: Vec<String> =
        THROTTLE_REASONS.iter().filter(|(b, _)| bits & b != 0).map(|(_, n)| n.to_string()).collect();
    let known: u64 = THROTTLE_REASONS.iter().map(|(b, _)| b).sum();
    if bits & !known != 0 {
        names.push(format!("unknown_0x{:x}", bits & !known));
    }
    names
}

/// The bit mask `throttle_names` was made from.
pub fn throttle_bits(names: &[String]) -> u64 {
    names
        .iter()
        .map(|n| match n.strip_prefix("unknown_0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap_or(0),
            None => THROTTLE_REASONS.iter().find(|(_, name)| name == n).map_or(0, |(b, _)| *b),
        })
        .fold(0, |a, b| a | b)
}

pub fn fabric_state(v: u32) -> FabricState {
    match v {
        1 => FabricState::NotStarted,
        2 => FabricState::InProgress,
        3 => FabricState::Completed,
        _ => FabricState::NotSupported,
    }
}

/// nvml.h return code names, for the fabric status NVML reports as a code.
pub fn return_code_name(code: u32) -> String {
    const NAMES: &[(u32, &str)] = &[
        (0, "NVML_SUCCESS"),
        (1, "NVML_ERROR_UNINITIALIZED"),
        (2, "NVML_ERROR_INVALID_ARGUMENT"),
        (3, "NVML_ERROR_NOT_SUPPORTED"),
        (4, "NVML_ERROR_NO_PERMISSION"),
        (6, "NVML_ERROR_NOT_FOUND"),
        (9, "NVML_ERROR_DRIVER_NOT_LOADED"),
        (10, "NVML_ERROR_TIMEOUT"),
        (15, "NVML_ERROR_GPU_IS_LOST"),
        (16, "NVML_ERROR_RESET_REQUIRED"),
        (18, "NVML_ERROR_LIB_RM_VERSION_MISMATCH"),
        (21, "NVML_ERROR_NO_DATA"),
        (27, "NVML_ERROR_NOT_READY"),
        (29, "NVML_ERROR_INVALID_STATE"),
        (999, "NVML_ERROR_UNKNOWN"),
    ];
    NAMES
        .iter()
        .find(|(c, _)| *c == code)
        .map(|(_, n)| n.to_string())
        .unwrap_or_else(|| format!("NVML return code {code}"))
}

fn format_uuid(b: &[u8; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// Watches NVML's event set for Xid errors in a thread of its own, blocking in
/// `nvmlEventSetWait` so an Xid is seen the moment the driver reports it (the service's path;
/// `doctor` drains what is pending instead). The thread shares the session's NVML handle, so
/// it starts only once NVML has answered, and an `nvmlInit_v2` that never returns leaves no
/// second thread behind. Dropping the watcher asks the thread to stop within one wait period;
/// it is not waited for, since a wait that never returns must not hold the service's stop.
pub struct XidWatcher {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

/// How long one blocking wait lasts before the thread looks at its stop flag. An Xid ends the
/// wait at once whatever this is, and nobody waits for a dropped watcher's thread, so it only
/// sets how often the thread wakes at rest: our choice, a few times a minute.
const WATCH_WAIT_MS: u32 = 15_000;

impl XidWatcher {
    /// Starts watching every GPU the session's NVML lists; events arrive on `tx`. `None`: NVML
    /// has not answered yet (no handle), or no thread could be started (said in the log).
    pub fn start(session: &Session, tx: std::sync::mpsc::Sender<NvmlXid>) -> Option<XidWatcher> {
        let held = session.handle()?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop_flag = stop.clone();
        let watched = session.watched();
        // Active before the thread's first wait, so no snapshot opens a set beside it.
        watched.lock().unwrap_or_else(|p| p.into_inner()).active = true;
        let account = watched.clone();
        match std::thread::Builder::new().name("nvml-xid".into()).spawn(move || {
            watch(&held.nvml, &stop_flag, &tx, &account);
            account.lock().unwrap_or_else(|p| p.into_inner()).active = false;
        }) {
            Ok(_) => Some(XidWatcher { stop }),
            Err(e) => {
                watched.lock().unwrap_or_else(|p| p.into_inner()).active = false;
                tracing::warn!(error = %e, "cannot start the Xid thread; the kernel log still shows Xids at each snapshot");
                None
            }
        }
    }
}

impl Drop for XidWatcher {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

fn watch(
    nvml: &Nvml,
    stop: &std::sync::atomic::AtomicBool,
    tx: &std::sync::mpsc::Sender<NvmlXid>,
    account: &std::sync::Mutex<session::Watched>,
) {
    let set = match xid_event_set(nvml, None, &Tracker::new("nvmlEventSetCreate")) {
        Ok((set, _, None)) => set,
        Ok((set, _, Some(e))) => {
            tracing::warn!(error = %e, "some GPUs cannot be watched for Xid events");
            set
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch for Xid events");
            return;
        }
    };
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match set.wait(WATCH_WAIT_MS) {
            Ok(ev) => {
                let Some(x) = xid_of(&ev) else { continue };
                tracing::warn!(gpu = %x.gpu, xid = x.xid, "Xid reported by NVML");
                account.lock().unwrap_or_else(|p| p.into_inner()).note(x.clone());
                if tx.send(x).is_err() {
                    return; // nobody listens any more
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "NVML event wait failed; Xid watching stops");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bus_ids() {
        assert_eq!(normalize_bus_id("00000000:09:00.0").as_deref(), Some("0000:09:00.0"));
        assert_eq!(normalize_bus_id("00000000:9B:00.0").as_deref(), Some("0000:9b:00.0"));
        assert_eq!(normalize_bus_id("0000:0a:00.0").as_deref(), Some("0000:0a:00.0"));
        assert_eq!(normalize_bus_id("garbage"), None);
    }

    #[test]
    fn throttle_bits_and_names() {
        assert_eq!(throttle_names(0x41), vec!["gpu_idle", "hw_thermal_slowdown"]);
        assert_eq!(throttle_names(0x1000), vec!["unknown_0x1000"]);
        for bits in [0, 0x41, 0x1fff, 0x1_0000_0004] {
            assert_eq!(throttle_bits(&throttle_names(bits)), bits);
        }
    }

    #[test]
    fn uuid_format() {
        assert_eq!(format_uuid(&[0; 16]), "00000000-0000-0000-0000-000000000000");
    }

    proptest! {
        #[test]
        fn bus_id_never_panics(s in ".*") {
            let _ = normalize_bus_id(&s);
        }
    }
}
