//! A small working NVML: a `cdylib` that exports the NVML C functions phq-agent calls and
//! answers them from the JSON scenario named by `PHQ_FAKE_NVML_SCENARIO` (format v1,
//! docs/fake-nvml-scenario.md), read at `nvmlInit_v2`.
//!
//! Rules of the format, kept here:
//! - a field that is absent makes its call return `NVML_ERROR_NOT_SUPPORTED`, never a made-up
//!   value; so does a function named in the device's `unsupported` list;
//! - a function named in the device's `errors` map returns that code;
//! - Xid events are delivered through the event set `after_ms` after `nvmlInit_v2`;
//! - a call named in `hangs` blocks, on that GPU only, until the hang's end (`hang`).
//!
//! Struct layouts come from `nvml-wrapper-sys`, the same bindings the agent uses, so the two
//! sides cannot disagree about them.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use nvml_wrapper_sys::bindings::*;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_uint, c_ulonglong};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod ecc;
mod events;
pub mod gpm;
pub mod load;
pub mod scenario;
use scenario::{Device, Scenario};

type Ret = nvmlReturn_t;
const OK: Ret = nvmlReturn_enum_NVML_SUCCESS;
const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const INVALID: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const UNINITIALIZED: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const ARGUMENT_VERSION_MISMATCH: Ret = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;

/// NVML return codes by name, as the scenario writes them.
pub const RETURN_CODES: &[(&str, Ret)] = &[
    ("NVML_SUCCESS", 0),
    ("NVML_ERROR_UNINITIALIZED", 1),
    ("NVML_ERROR_INVALID_ARGUMENT", 2),
    ("NVML_ERROR_NOT_SUPPORTED", 3),
    ("NVML_ERROR_NO_PERMISSION", 4),
    ("NVML_ERROR_ALREADY_INITIALIZED", 5),
    ("NVML_ERROR_NOT_FOUND", 6),
    ("NVML_ERROR_INSUFFICIENT_SIZE", 7),
    ("NVML_ERROR_INSUFFICIENT_POWER", 8),
    ("NVML_ERROR_DRIVER_NOT_LOADED", 9),
    ("NVML_ERROR_TIMEOUT", 10),
    ("NVML_ERROR_IRQ_ISSUE", 11),
    ("NVML_ERROR_LIBRARY_NOT_FOUND", 12),
    ("NVML_ERROR_FUNCTION_NOT_FOUND", 13),
    ("NVML_ERROR_CORRUPTED_INFOROM", 14),
    ("NVML_ERROR_GPU_IS_LOST", 15),
    ("NVML_ERROR_RESET_REQUIRED", 16),
    ("NVML_ERROR_OPERATING_SYSTEM", 17),
    ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", 18),
    ("NVML_ERROR_IN_USE", 19),
    ("NVML_ERROR_MEMORY", 20),
    ("NVML_ERROR_NO_DATA", 21),
    ("NVML_ERROR_INSUFFICIENT_RESOURCES", 23),
    ("NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25),
    ("NVML_ERROR_NOT_READY", 27),
    ("NVML_ERROR_GPU_NOT_FOUND", 28),
    ("NVML_ERROR_INVALID_STATE", 29),
    ("NVML_ERROR_UNKNOWN", 999),
];

pub fn code(name: &str) -> Ret {
    RETURN_CODES.iter().find(|(n, _)| *n == name).map(|(_, c)| *c).unwrap_or(nvmlReturn_enum_NVML_ERROR_UNKNOWN)
}

struct State {
    /// nvmlInit_v2 calls not yet matched by nvmlShutdown: NVML counts them, and only the last
    /// shutdown tears the library down (an agent has several handles open at once).
    refs: usize,
    scenario: Scenario,
    started: Instant,
    /// Event sets: registered devices, and how many of each device's Xid events were delivered.
    sets: HashMap<usize, EventSet>,
    next_set: usize,
}

#[derive(Default)]
struct EventSet {
    devices: Vec<usize>,
    delivered: BTreeMap<usize, usize>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_state<T>(f: impl FnOnce(&mut State) -> Result<T, Ret>) -> Result<T, Ret> {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    match guard.as_mut() {
        Some(s) => f(s),
        None => Err(UNINITIALIZED),
    }
}

/// Device handles are their index + 1, so a null handle is never valid.
fn handle_of(index: usize) -> nvmlDevice_t {
    (index + 1) as nvmlDevice_t
}

fn index_of(h: nvmlDevice_t) -> usize {
    (h as usize).wrapping_sub(1)
}

/// The functions a scenario's `hangs` may name: those that pass through `hang`. Any other name
/// is refused at `nvmlInit_v2`, so a typo cannot quietly test a machine that answers.
pub const HANGABLE: &[&str] = &[
    "nvmlInit_v2",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlSystemGetDriverVersion",
    "nvmlEventSetWait_v2",
    "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetBAR1MemoryInfo",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetGpuFabricInfo",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetMemoryErrorCounter",
    "nvmlDeviceGetModuleId",
    "nvmlDeviceGetViolationStatus",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceValidateInforom",
];

/// When the process first called `nvmlInit_v2`: the clock of every hang's `until_ms`.
static FIRST_INIT: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Blocks the calling thread while the scenario says `function` on GPU `gpu` hangs.
///
/// The real behaviour this keeps: on a GPU that has fallen off the bus or whose GSP stopped
/// answering, NVML calls do not fail, they block.
/// - NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html):
///   Xid 79 `ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS` and Xid 119 `GSP_RPC_TIMEOUT`, the two
///   states an operator first meets as a hanging `nvidia-smi`.
/// - NVIDIA/open-gpu-kernel-modules issue #446 ("Timeout waiting for RPC from GSP!"): the kernel
///   log shows Xid 119 for `name=nvidia-smi`, one every 45 s for the same pid, each a control
///   call that waited 45 s for the GSP; the one `nvidia-smi` stays blocked for minutes.
/// - leptonai/gpud pull request #117: `nvidia-smi` "may get stuck forever" after Xid 45, in
///   uninterruptible sleep (state D), which is why gpud runs it asynchronously.
///
/// The block is per call and per GPU: the other GPUs' calls keep answering (the state lock is
/// not held while blocked), so a reader that gives up on one GPU can still read the others.
fn hang(function: &str, gpu: Option<usize>) {
    let until = {
        let guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = guard.as_ref() else { return };
        match hang_of(&s.scenario, function, gpu) {
            Some(until) => until,
            None => return,
        }
    };
    block_until(until);
}

/// `Some(None)`: `function` on `gpu` hangs for good; `Some(Some(t))`: until `t`; `None`: it answers.
fn hang_of(scenario: &Scenario, function: &str, gpu: Option<usize>) -> Option<Option<Instant>> {
    let h = scenario.hangs.iter().find(|h| h.function == function && (h.gpu.is_none() || h.gpu == gpu))?;
    let first = *FIRST_INIT.get_or_init(Instant::now);
    match h.until_ms {
        None => Some(None),
        Some(ms) => {
            let end = first + Duration::from_millis(ms);
            (Instant::now() < end).then_some(Some(end))
        }
    }
}

fn block_until(until: Option<Instant>) {
    match until {
        Some(t) => std::thread::sleep(t.saturating_duration_since(Instant::now())),
        // Until the process ends, as a call stuck in the kernel does.
        None => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
    }
}

/// Runs `f` on the device behind `h`, after the scenario's `hangs`, `errors` and `unsupported`
/// lists for function `name` have had their say. `f` returns `None` for an absent field.
fn device_call(h: nvmlDevice_t, name: &str, f: impl FnOnce(&Device) -> Option<Ret>) -> Ret {
    hang(name, Some(index_of(h)));
    with_state(|s| {
        let d = s.scenario.devices.get(index_of(h)).ok_or(INVALID)?;
        if let Some(e) = d.errors.get(name) {
            return Err(code(e));
        }
        if d.unsupported.iter().any(|u| u == name) {
            return Err(NOT_SUPPORTED);
        }
        Ok(f(d).unwrap_or(NOT_SUPPORTED))
    })
    .unwrap_or_else(|e| e)
}

/// Copies `s` into a C buffer of `len` bytes with its NUL, as NVML does.
unsafe fn put_str(s: &str, buf: *mut c_char, len: c_uint) -> Ret {
    if buf.is_null() {
        return INVALID;
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return INSUFFICIENT_SIZE;
    }
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, buf, bytes.len());
    *buf.add(bytes.len()) = 0;
    OK
}

unsafe fn put<T>(out: *mut T, v: T) -> Ret {
    if out.is_null() {
        return INVALID;
    }
    *out = v;
    OK
}

// ---------------------------------------------------------------------------------------
// Library and system

/// Calls of `nvmlInit_v2` in this process. Not an NVML function: tests read it through
/// `phqFakeNvmlInitCount` to show that a service keeps one NVML session instead of paying an
/// init (seconds on a real 8-GPU guest) per snapshot.
static INIT_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[no_mangle]
pub extern "C" fn phqFakeNvmlInitCount() -> u64 {
    INIT_CALLS.load(std::sync::atomic::Ordering::SeqCst)
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> Ret {
    INIT_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    FIRST_INIT.get_or_init(Instant::now);
    // Held throughout, so two first inits cannot both load the scenario.
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = guard.as_mut() {
        s.refs += 1;
        return OK;
    }
    let scenario = match std::env::var("PHQ_FAKE_NVML_SCENARIO") {
        Ok(path) => match std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<Scenario>(&t).map_err(|e| e.to_string()))
        {
            Ok(s) => s,
            Err(e) => {
                eprintln!("fake-nvml: {path}: {e}");
                return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
            }
        },
        Err(_) => {
            eprintln!("fake-nvml: PHQ_FAKE_NVML_SCENARIO is not set");
            return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
        }
    };
    if let Some(bad) = scenario.hangs.iter().find(|h| !HANGABLE.contains(&h.function.as_str())) {
        eprintln!("fake-nvml: hangs: {} does not pass through the hang point (see HANGABLE)", bad.function);
        return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
    }
    if let Some(ms) = scenario.init_delay_ms {
        std::thread::sleep(Duration::from_millis(ms));
    }
    // An init that hangs holds the state lock, as the real one serialises initialisation: a
    // second caller waits behind it.
    if let Some(until) = hang_of(&scenario, "nvmlInit_v2", None) {
        block_until(until);
    }
    if let Some(e) = &scenario.init_error {
        return code(e);
    }
    *guard = Some(State { refs: 1, scenario, started: Instant::now(), sets: HashMap::new(), next_set: 1 });
    OK
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> Ret {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> Ret {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    match guard.as_mut() {
        Some(s) if s.refs > 1 => {
            s.refs -= 1;
            OK
        }
        Some(_) => {
            *guard = None;
            OK
        }
        None => UNINITIALIZED,
    }
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(result: Ret) -> *const c_char {
    static NAMES: std::sync::OnceLock<Vec<(Ret, std::ffi::CString)>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        RETURN_CODES.iter().filter_map(|(n, c)| std::ffi::CString::new(*n).ok().map(|s| (*c, s))).collect()
    });
    names
        .iter()
        .find(|(c, _)| *c == result)
        .or_else(|| names.last())
        .map(|(_, s)| s.as_ptr())
        .unwrap_or(std::ptr::null())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> Ret {
    hang("nvmlSystemGetDriverVersion", None);
    with_state(|s| s.scenario.driver_version.clone().ok_or(NOT_SUPPORTED))
        .map(|v| put_str(&v, buf, len))
        .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: c_uint) -> Ret {
    with_state(|s| s.scenario.nvml_version.clone().ok_or(NOT_SUPPORTED))
        .map(|v| put_str(&v, buf, len))
        .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(out: *mut i32) -> Ret {
    with_state(|s| s.scenario.cuda_driver_version.ok_or(NOT_SUPPORTED)).map(|v| put(out, v)).unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(out: *mut i32) -> Ret {
    nvmlSystemGetCudaDriverVersion_v2(out)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(out: *mut c_uint) -> Ret {
    hang("nvmlDeviceGetCount_v2", None);
    with_state(|s| Ok(s.scenario.devices.len() as c_uint)).map(|n| put(out, n)).unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, out: *mut nvmlDevice_t) -> Ret {
    hang("nvmlDeviceGetHandleByIndex_v2", Some(index as usize));
    with_state(
        |s| if (index as usize) < s.scenario.devices.len() { Ok(handle_of(index as usize)) } else { Err(INVALID) },
    )
    .map(|h| put(out, h))
    .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(h: nvmlDevice_t, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetIndex", |_| Some(put(out, index_of(h) as c_uint)))
}

// ---------------------------------------------------------------------------------------
// Identity

macro_rules! string_getter {
    ($fn_name:ident, $field:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $fn_name(h: nvmlDevice_t, buf: *mut c_char, len: c_uint) -> Ret {
            device_call(h, stringify!($fn_name), |d| d.$field.as_deref().map(|v| put_str(v, buf, len)))
        }
    };
}

string_getter!(nvmlDeviceGetName, name);
string_getter!(nvmlDeviceGetUUID, uuid);
string_getter!(nvmlDeviceGetSerial, serial);
string_getter!(nvmlDeviceGetBoardPartNumber, board_part_number);
string_getter!(nvmlDeviceGetVbiosVersion, vbios_version);
string_getter!(nvmlDeviceGetInforomImageVersion, inforom_image_version);

/// "A unique identifier for each GPU module that exists on a given baseboard. For non-baseboard
/// products, this ID would always be 0." (NVML API reference, `nvmlDeviceGetModuleId`). The
/// scenario gives the number; a device without it answers NVML_ERROR_NOT_SUPPORTED, as other
/// getters here do for what a device lacks.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetModuleId(h: nvmlDevice_t, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetModuleId", |d| d.module_id.map(|m| put(out, m)))
}

#[no_mangle]
pub extern "C" fn nvmlDeviceValidateInforom(h: nvmlDevice_t) -> Ret {
    device_call(h, "nvmlDeviceValidateInforom", |d| {
        d.inforom_valid.map(|ok| if ok { OK } else { nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(h: nvmlDevice_t, out: *mut nvmlPciInfo_t) -> Ret {
    device_call(h, "nvmlDeviceGetPciInfo_v3", |d| {
        let p = d.pci.as_ref()?;
        if out.is_null() {
            return Some(INVALID);
        }
        *out = pci_info(
            &p.bus_id,
            scenario::parse_u32(&p.pci_device_id).unwrap_or(0),
            p.pci_subsystem_id.as_deref().and_then(scenario::parse_u32).unwrap_or(0),
        );
        Some(OK)
    })
}

/// An `nvmlPciInfo_t` for `bus_id` (`00000000:09:00.0`).
fn pci_info(bus_id: &str, device_id: u32, subsystem_id: u32) -> nvmlPciInfo_t {
    // SAFETY: nvmlPciInfo_t is plain data (integers and char arrays); all zeroes is valid.
    let mut info: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
    let parts: Vec<&str> = bus_id.split([':', '.']).collect();
    let hex = |i: usize| parts.get(i).and_then(|v| u32::from_str_radix(v, 16).ok()).unwrap_or(0);
    info.domain = hex(0);
    info.bus = hex(1);
    info.device = hex(2);
    info.pciDeviceId = device_id;
    info.pciSubSystemId = subsystem_id;
    let legacy = format!("{:04x}:{:02x}:{:02x}.0", info.domain, info.bus, info.device).to_uppercase();
    for (dst, src) in info.busId.iter_mut().zip(bus_id.bytes().take(31)) {
        *dst = src as c_char;
    }
    for (dst, src) in info.busIdLegacy.iter_mut().zip(legacy.bytes().take(15)) {
        *dst = src as c_char;
    }
    info
}

// ---------------------------------------------------------------------------------------
// Memory, thermals, power, clocks

/// `NVML_STRUCT_VERSION(Memory, 2)` (nvml.h): the struct's size with the version in the top byte.
const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);

/// Rules, with their sources:
/// - the caller must set `version` to `nvmlMemory_v2` (nvml.h: "Structure format version (must
///   be 2)"); anything else is `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`;
/// - `used` leaves the reservation out and `free` is what remains after both:
///   total = reserved + used + free. nvml.h's note says `used` includes `reserved`, but the
///   real driver does not: on an A100, v1's `used` (reservation included) read 912 MB and v2's
///   7.8 MB, matching nvidia-smi (nvml-wrapper issue #57); and dcgm-exporter's users find
///   FB_USED + FB_FREE short of the total by FB_RESERVED (dcgm-exporter issue #271). So a
///   reader that takes `total - used` as free overstates it by the reservation.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(h: nvmlDevice_t, out: *mut nvmlMemory_v2_t) -> Ret {
    device_call(h, "nvmlDeviceGetMemoryInfo_v2", |d| {
        let m = d.memory.as_ref()?;
        if out.is_null() {
            return Some(INVALID);
        }
        if (*out).version != MEMORY_V2_VERSION {
            return Some(ARGUMENT_VERSION_MISMATCH);
        }
        (*out).total = m.total_bytes;
        (*out).reserved = m.reserved_bytes;
        (*out).used = m.used_bytes;
        (*out).free = m.total_bytes.saturating_sub(m.reserved_bytes).saturating_sub(m.used_bytes);
        Some(OK)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetBAR1MemoryInfo(h: nvmlDevice_t, out: *mut nvmlBAR1Memory_t) -> Ret {
    device_call(h, "nvmlDeviceGetBAR1MemoryInfo", |d| {
        let m = d.bar1.as_ref()?;
        Some(put(
            out,
            nvmlBAR1Memory_t {
                bar1Total: m.total_bytes,
                bar1Used: m.used_bytes,
                bar1Free: m.total_bytes.saturating_sub(m.used_bytes),
            },
        ))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(h: nvmlDevice_t, _sensor: c_uint, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetTemperature", |d| d.temperature_c.map(|t| put(out, t)))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureThreshold(h: nvmlDevice_t, kind: c_uint, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetTemperatureThreshold", |d| {
        let v = match kind {
            NVML_TEMPERATURE_THRESHOLD_SHUTDOWN => d.shutdown_temperature_c,
            NVML_TEMPERATURE_THRESHOLD_SLOWDOWN => d.slowdown_temperature_c,
            _ => None,
        };
        v.map(|t| put(out, t))
    })
}

const NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: c_uint = 0;
const NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: c_uint = 1;

/// The scenario's reading; while the fake CUDA in this process runs GEMMs on the GPU, what its
/// board draws under load (`load.rs`), never above the limit it enforces (NVML API reference,
/// `nvmlDeviceGetEnforcedPowerLimit`: the limit the power management algorithm holds the board to).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(h: nvmlDevice_t, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetPowerUsage", |d| {
        let limit = d.power_limit_mw.or(d.default_power_limit_mw);
        let loaded = match (d.pci.as_ref().map(|p| load::load_mw(&p.bus_id)), limit) {
            (Some(0), Some(l)) => Some(l),
            (Some(mw), l) if mw > 0 => Some(l.map_or(mw as u32, |l| l.min(mw.min(u32::MAX as i64) as u32))),
            _ => None,
        };
        loaded.or(d.power_usage_mw).map(|v| put(out, v))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(h: nvmlDevice_t, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetEnforcedPowerLimit", |d| d.power_limit_mw.map(|v| put(out, v)))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(h: nvmlDevice_t, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetPowerManagementDefaultLimit", |d| d.default_power_limit_mw.map(|v| put(out, v)))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(h: nvmlDevice_t, kind: c_uint, out: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetClockInfo", |d| {
        let c = d.clocks_mhz.as_ref()?;
        // nvmlClockType_t: 0 graphics, 1 SM, 2 memory, 3 video
        let v = match kind {
            0 | 1 => c.sm,
            2 => c.mem,
            _ => None,
        };
        v.map(|v| put(out, v))
    })
}

/// NVML clocks-event (throttle) reason bits by the scenario's names.
pub const THROTTLE_BITS: &[(&str, u64)] = &[
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
];

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(h: nvmlDevice_t, out: *mut c_ulonglong) -> Ret {
    device_call(h, "nvmlDeviceGetCurrentClocksThrottleReasons", |d| {
        let names = d.throttle_reasons.as_ref()?;
        let bits = names
            .iter()
            .filter_map(|n| THROTTLE_BITS.iter().find(|(b, _)| b == n).map(|(_, v)| *v))
            .fold(0, |a, b| a | b);
        Some(put(out, bits))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(h: nvmlDevice_t, out: *mut c_ulonglong) -> Ret {
    nvmlDeviceGetCurrentClocksThrottleReasons(h, out)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(h: nvmlDevice_t, out: *mut nvmlUtilization_t) -> Ret {
    device_call(h, "nvmlDeviceGetUtilizationRates", |d| {
        d.utilization.as_ref().map(|u| put(out, nvmlUtilization_t { gpu: u.gpu, memory: u.memory }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(h: nvmlDevice_t, out: *mut c_ulonglong) -> Ret {
    device_call(h, "nvmlDeviceGetTotalEnergyConsumption", |d| d.energy_mj.map(|v| put(out, v)))
}

/// The sampling period NVML reports beside encoder/decoder utilisation, in microseconds. nvml.h
/// leaves it to the product; a sixth of a second is the shortest period it names for
/// utilisation samples ("between 1 second and 1/6 second").
const CODEC_SAMPLING_PERIOD_US: c_uint = 166_667;

unsafe fn codec_utilization(v: Option<u32>, util: *mut c_uint, period: *mut c_uint) -> Option<Ret> {
    let v = v?;
    if util.is_null() || period.is_null() {
        return Some(INVALID);
    }
    *util = v;
    *period = CODEC_SAMPLING_PERIOD_US;
    Some(OK)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    h: nvmlDevice_t,
    util: *mut c_uint,
    period: *mut c_uint,
) -> Ret {
    device_call(h, "nvmlDeviceGetEncoderUtilization", |d| codec_utilization(d.encoder_utilization, util, period))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    h: nvmlDevice_t,
    util: *mut c_uint,
    period: *mut c_uint,
) -> Ret {
    device_call(h, "nvmlDeviceGetDecoderUtilization", |d| codec_utilization(d.decoder_utilization, util, period))
}

// ---------------------------------------------------------------------------------------
// Field values

/// Field ids (nvml.h, "Field Identifiers") this fake answers.
const FI_DEV_MEMORY_TEMP: c_uint = 82;
const FI_DEV_NVLINK_THROUGHPUT_DATA_TX: c_uint = 138;
const FI_DEV_NVLINK_THROUGHPUT_DATA_RX: c_uint = 139;
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (nvml.h: "GPU Recovery action - None/Reset/Reboot/Drain
/// P2P/Drain and Reset"), an unsigned int; NVIDIA/go-nvml `gen/nvml/nvml.h`.
const FI_DEV_GET_GPU_RECOVERY_ACTION: c_uint = 230;

/// `nvmlDeviceGetFieldValues`, with nvml.h's rules:
/// - the call itself fails only for bad arguments (a null array, a count below 1); each field
///   carries its own `nvmlReturn`, so one field the GPU lacks does not fail the others;
/// - a field the device does not know is `NVML_ERROR_NOT_SUPPORTED` in its entry;
/// - the value goes in the union member `valueType` names;
/// - NVLink throughput counters are per link: `scopeId` is the link, and `UINT_MAX` sums all
///   links ("A scopeId of UINT_MAX returns aggregate value summed up across all links"), so a
///   caller that leaves `scopeId` at 0 gets link 0 alone, not an error; a link past the last is
///   `NVML_ERROR_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(h: nvmlDevice_t, count: i32, values: *mut nvmlFieldValue_t) -> Ret {
    device_call(h, "nvmlDeviceGetFieldValues", |d| {
        if values.is_null() || count < 1 {
            return Some(INVALID);
        }
        let fields = std::slice::from_raw_parts_mut(values, count as usize);
        for f in fields {
            f.timestamp = 0;
            f.latencyUsec = 0;
            let (ret, value) = field_value(d, f.fieldId, f.scopeId);
            f.nvmlReturn = ret;
            if let Some((kind, v)) = value {
                f.valueType = kind;
                f.value = v;
            }
        }
        Some(OK)
    })
}

fn field_value(d: &Device, field: c_uint, scope: c_uint) -> (Ret, Option<(nvmlValueType_t, nvmlValue_t)>) {
    let uint = |v: u32| (OK, Some((nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT, nvmlValue_t { uiVal: v })));
    let ull = |v: u64| (OK, Some((nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlValue_t { ullVal: v })));
    match field {
        FI_DEV_MEMORY_TEMP => d.memory_temperature_c.map_or((NOT_SUPPORTED, None), uint),
        FI_DEV_GET_GPU_RECOVERY_ACTION => d.recovery_action.map_or((NOT_SUPPORTED, None), uint),
        FI_DEV_NVLINK_THROUGHPUT_DATA_TX | FI_DEV_NVLINK_THROUGHPUT_DATA_RX => {
            let Some(links) = d.nvlinks.as_ref() else { return (NOT_SUPPORTED, None) };
            let pick =
                |l: &scenario::NvLink| if field == FI_DEV_NVLINK_THROUGHPUT_DATA_TX { l.tx_kib } else { l.rx_kib };
            if scope == u32::MAX {
                ull(links.iter().map(pick).sum())
            } else {
                match links.get(scope as usize) {
                    Some(l) => ull(pick(l)),
                    None => (INVALID, None),
                }
            }
        }
        _ => (NOT_SUPPORTED, None),
    }
}

// ---------------------------------------------------------------------------------------
// PCIe

macro_rules! pcie_getter {
    ($fn_name:ident, $field:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $fn_name(h: nvmlDevice_t, out: *mut c_uint) -> Ret {
            device_call(h, stringify!($fn_name), |d| d.pcie.as_ref().and_then(|p| p.$field).map(|v| put(out, v)))
        }
    };
}

pcie_getter!(nvmlDeviceGetCurrPcieLinkGeneration, gen_current);
pcie_getter!(nvmlDeviceGetMaxPcieLinkGeneration, gen_max);
pcie_getter!(nvmlDeviceGetCurrPcieLinkWidth, width_current);
pcie_getter!(nvmlDeviceGetMaxPcieLinkWidth, width_max);
pcie_getter!(nvmlDeviceGetPcieReplayCounter, replay_counter);

// ---------------------------------------------------------------------------------------
// NVLink and fabric

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(h: nvmlDevice_t, link: c_uint, out: *mut nvmlEnableState_t) -> Ret {
    device_call(h, "nvmlDeviceGetNvLinkState", |d| {
        let links = d.nvlinks.as_ref()?;
        Some(match links.get(link as usize) {
            Some(l) => put(out, l.active as nvmlEnableState_t),
            None => INVALID,
        })
    })
}

/// The remote end's PCI address; NVML leaves `pciSubSystemId` unfilled here ("not filled in
/// this function and is indeterminate", NVML API reference), so the fake leaves it 0.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    h: nvmlDevice_t,
    link: c_uint,
    out: *mut nvmlPciInfo_t,
) -> Ret {
    device_call(h, "nvmlDeviceGetNvLinkRemotePciInfo_v2", |d| {
        let links = d.nvlinks.as_ref()?;
        let Some(l) = links.get(link as usize) else { return Some(INVALID) };
        let remote = l.remote_pci.as_deref()?;
        if out.is_null() {
            return Some(INVALID);
        }
        *out = pci_info(remote, 0, 0);
        Some(OK)
    })
}

/// Peer-to-peer status of a pair for one capability (NVML API reference,
/// nvmlDeviceGetP2PStatus: the status is an `nvmlGpuP2PStatus_t`, OK or the reason the pair
/// cannot). Only the NVLink capability is modelled: the others answer NOT_SUPPORTED (the query
/// itself), as an absent field does.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    a: nvmlDevice_t,
    b: nvmlDevice_t,
    index: nvmlGpuP2PCapsIndex_t,
    out: *mut nvmlGpuP2PStatus_t,
) -> Ret {
    const NAME: &str = "nvmlDeviceGetP2PStatus";
    hang(NAME, Some(index_of(a)));
    hang(NAME, Some(index_of(b)));
    with_state(|s| {
        let da = s.scenario.devices.get(index_of(a)).ok_or(INVALID)?;
        let db = s.scenario.devices.get(index_of(b)).ok_or(INVALID)?;
        for d in [da, db] {
            if let Some(e) = d.errors.get(NAME) {
                return Err(code(e));
            }
            if d.unsupported.iter().any(|u| u == NAME) {
                return Err(NOT_SUPPORTED);
            }
        }
        if out.is_null() {
            return Err(INVALID);
        }
        if index != nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK {
            return Err(NOT_SUPPORTED);
        }
        let (Some(x), Some(y)) = (da.nvlink_p2p.as_deref(), db.nvlink_p2p.as_deref()) else {
            return Err(NOT_SUPPORTED);
        };
        let status = |v: &str| match v {
            "ok" => nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK,
            "gpu_not_supported" => nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_GPU_NOT_SUPPORTED,
            "disabled_by_regkey" => nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_DISABLED_BY_REGKEY,
            "not_supported" => nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED,
            _ => nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_UNKNOWN,
        };
        *out = if x != "ok" { status(x) } else { status(y) };
        Ok(OK)
    })
    .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    h: nvmlDevice_t,
    link: c_uint,
    counter: c_uint,
    out: *mut c_ulonglong,
) -> Ret {
    device_call(h, "nvmlDeviceGetNvLinkErrorCounter", |d| {
        let links = d.nvlinks.as_ref()?;
        let Some(l) = links.get(link as usize) else { return Some(INVALID) };
        // nvmlNvLinkErrorCounter_t: 0 DL_REPLAY, 1 DL_RECOVERY, 2 DL_CRC_FLIT, 3 DL_CRC_DATA
        let v = match counter {
            0 => l.replay_errors,
            1 => l.recovery_errors,
            2 => l.crc_flit_errors,
            3 => l.crc_data_errors,
            _ => return Some(INVALID),
        };
        Some(put(out, v))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(h: nvmlDevice_t, out: *mut nvmlGpuFabricInfo_t) -> Ret {
    device_call(h, "nvmlDeviceGetGpuFabricInfo", |d| {
        let f = d.fabric.as_ref()?;
        let state = match f.state.as_str() {
            "not_started" => NVML_GPU_FABRIC_STATE_NOT_STARTED,
            "in_progress" => NVML_GPU_FABRIC_STATE_IN_PROGRESS,
            "completed" => NVML_GPU_FABRIC_STATE_COMPLETED,
            _ => NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
        } as nvmlGpuFabricState_t;
        let mut uuid = [0u8; 16];
        let hex: String = f.cluster_uuid.as_deref().unwrap_or("").chars().filter(|c| c.is_ascii_hexdigit()).collect();
        for (i, b) in uuid.iter_mut().enumerate() {
            *b = hex.get(i * 2..i * 2 + 2).and_then(|h| u8::from_str_radix(h, 16).ok()).unwrap_or(0);
        }
        Some(put(
            out,
            nvmlGpuFabricInfo_t {
                clusterUuid: uuid,
                status: code(f.status.as_deref().unwrap_or("NVML_SUCCESS")),
                cliqueId: f.clique_id.unwrap_or(0),
                state,
            },
        ))
    })
}

// ---------------------------------------------------------------------------------------
// Processes

/// Size queries (`infos` null) of each device's process list in this process so far: a
/// scenario's process with `from_query: N` is listed from the Nth query on, and the data call
/// that follows a query answers as that query did.
///
/// Rule: the list is live. NVML's reference for `nvmlDeviceGetComputeRunningProcesses_v3` "gets
/// information about processes with a compute context on a device" as they are at the call, so a
/// job that starts between two calls is in the second answer; callers size their buffer with a
/// first call (`*infoCount` 0, `infos` NULL, answered `NVML_ERROR_INSUFFICIENT_SIZE` with the
/// count) and read with a second (nvml-wrapper's `running_compute_processes`, which adds room
/// for processes "launched in between").
static PROCESS_QUERIES: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// The query number a call of `index`'s process list answers as (see `PROCESS_QUERIES`).
fn process_query(index: usize, sizing: bool) -> u32 {
    let mut q = PROCESS_QUERIES.lock().unwrap_or_else(|p| p.into_inner());
    if q.len() <= index {
        q.resize(index + 1, 0);
    }
    if sizing || q[index] == 0 {
        q[index] += 1;
    }
    q[index]
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    h: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> Ret {
    let query = process_query(index_of(h), infos.is_null());
    device_call(h, "nvmlDeviceGetComputeRunningProcesses_v3", |d| {
        let procs: Vec<&scenario::Process> =
            d.processes.as_ref()?.iter().filter(|p| p.from_query.is_none_or(|n| query >= n)).collect();
        if count.is_null() {
            return Some(INVALID);
        }
        let room = *count as usize;
        *count = procs.len() as c_uint;
        if procs.len() > room || (infos.is_null() && !procs.is_empty()) {
            return Some(INSUFFICIENT_SIZE);
        }
        for (i, p) in procs.iter().enumerate() {
            *infos.add(i) = nvmlProcessInfo_t {
                pid: if p.caller { std::process::id() } else { p.pid },
                usedGpuMemory: p.used_bytes,
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            };
        }
        Some(OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules a reader can break without a crash, each answered as nvml.h says. One test,
    /// because the library's state is one per process.
    #[test]
    fn memory_v2_and_field_value_rules() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let scenario = dir.join("s.json");
        std::fs::write(
            &scenario,
            r#"{"devices": [{
                "memory": {"total_bytes": 1000, "used_bytes": 100, "reserved_bytes": 300},
                "memory_temperature_c": 40,
                "recovery_action": 1,
                "nvlinks": [{"active": true, "tx_kib": 5, "rx_kib": 7}, {"active": true, "tx_kib": 11, "rx_kib": 13}]
            }]}"#,
        )
        .unwrap();
        std::env::set_var("PHQ_FAKE_NVML_SCENARIO", &scenario);
        assert_eq!(nvmlInit_v2(), OK);
        let h = handle_of(0);
        unsafe {
            // A v2 struct without its version is refused, as the real library refuses it.
            let mut m: nvmlMemory_v2_t = std::mem::zeroed();
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h, &mut m), ARGUMENT_VERSION_MISMATCH);
            m.version = MEMORY_V2_VERSION;
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h, &mut m), OK);
            assert_eq!((m.total, m.reserved, m.used, m.free), (1000, 300, 100, 600));

            let field = |id: c_uint, scope: c_uint| {
                let mut v: nvmlFieldValue_t = std::mem::zeroed();
                v.fieldId = id;
                v.scopeId = scope;
                v
            };
            let mut vs = [
                field(FI_DEV_MEMORY_TEMP, 0),
                field(FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0),
                field(FI_DEV_NVLINK_THROUGHPUT_DATA_TX, u32::MAX),
                field(FI_DEV_NVLINK_THROUGHPUT_DATA_RX, u32::MAX),
                field(FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 2),
                field(9999, 0),
                field(FI_DEV_GET_GPU_RECOVERY_ACTION, 0),
            ];
            assert_eq!(nvmlDeviceGetFieldValues(h, vs.len() as i32, vs.as_mut_ptr()), OK);
            assert_eq!((vs[0].nvmlReturn, vs[0].valueType, vs[0].value.uiVal), (OK, 1, 40));
            // scopeId 0 is link 0 alone: no error, just the smaller figure.
            assert_eq!((vs[1].nvmlReturn, vs[1].value.ullVal), (OK, 5));
            assert_eq!((vs[2].nvmlReturn, vs[2].valueType, vs[2].value.ullVal), (OK, 3, 16));
            assert_eq!(vs[3].value.ullVal, 20);
            assert_eq!(vs[4].nvmlReturn, INVALID, "a link past the last");
            assert_eq!(vs[5].nvmlReturn, NOT_SUPPORTED, "an unknown field");
            assert_eq!((vs[6].nvmlReturn, vs[6].valueType, vs[6].value.uiVal), (OK, 1, 1), "GPU reset required");
            assert_eq!(nvmlDeviceGetFieldValues(h, 0, vs.as_mut_ptr()), INVALID);
        }
        assert_eq!(nvmlShutdown(), OK);
        let _ = std::fs::remove_dir_all(dir);
    }
}
