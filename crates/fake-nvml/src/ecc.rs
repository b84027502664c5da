//! ECC, row remapping and modes (ECC, persistence, MIG), and the clock violation counters:
//! the getters whose answers a GPU's memory health is judged by. Split from `lib.rs` by area;
//! the rules each keeps are beside it, with their sources.

use super::*;

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    h: nvmlDevice_t,
    current: *mut nvmlEnableState_t,
    pending: *mut nvmlEnableState_t,
) -> Ret {
    device_call(h, "nvmlDeviceGetEccMode", |d| {
        let e = d.ecc.as_ref()?;
        let (c, p) = (e.current?, e.pending?);
        Some(if put(current, c as nvmlEnableState_t) == OK { put(pending, p as nvmlEnableState_t) } else { INVALID })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    h: nvmlDevice_t,
    error_type: c_uint,
    counter_type: c_uint,
    out: *mut c_ulonglong,
) -> Ret {
    device_call(h, "nvmlDeviceGetTotalEccErrors", |d| {
        let e = d.ecc.as_ref()?;
        // nvmlMemoryErrorType_t: 0 corrected, 1 uncorrected; nvmlEccCounterType_t: 0 volatile, 1 aggregate
        let counts = if counter_type == 0 { e.volatile.as_ref()? } else { e.aggregate.as_ref()? };
        let rising = if counter_type == 0 && error_type == 0 && e.corrected_per_read > 0 {
            static READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            e.corrected_per_read * READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        } else {
            0
        };
        Some(put(out, if error_type == 0 { counts.corrected + rising } else { counts.uncorrected }))
    })
}

/// `nvmlDeviceGetMemoryErrorCounter(device, errorType, counterType, locationType, count)`, the
/// counts of one memory location (NVML API reference, Device Queries, ECC): `nvmlMemoryErrorType_t`
/// 0 corrected / 1 uncorrected, `nvmlEccCounterType_t` 0 volatile / 1 aggregate,
/// `nvmlMemoryLocation_t` 2 DRAM (device memory) and 7 SRAM as nvml.h numbers them. A location
/// the device does not count, or any other, is NVML_ERROR_NOT_SUPPORTED; a null `count` or an
/// error or counter type out of range is NVML_ERROR_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryErrorCounter(
    h: nvmlDevice_t,
    error_type: c_uint,
    counter_type: c_uint,
    location: c_uint,
    out: *mut c_ulonglong,
) -> Ret {
    device_call(h, "nvmlDeviceGetMemoryErrorCounter", |d| {
        if out.is_null() || error_type > 1 || counter_type > 1 {
            return Some(INVALID);
        }
        let e = d.ecc.as_ref()?;
        let place = match location {
            2 => e.dram.as_ref()?,
            7 => e.sram.as_ref()?,
            _ => return None,
        };
        let counts = if counter_type == 0 { &place.volatile } else { &place.aggregate };
        Some(put(out, if error_type == 0 { counts.corrected } else { counts.uncorrected }))
    })
}

/// `nvmlDeviceGetViolationStatus(device, perfPolicyType, violTime)`: how long the clocks were held
/// back for one reason (NVML API reference, Device Queries: `nvmlViolationTime_t.violationTime`
/// in ns, `referenceTime` the CPU time in µs). `nvmlPerfPolicyType_t` as nvml.h numbers it: 0
/// power, 1 thermal, 2 sync boost, 3 board limit, 4 low utilisation, 5 reliability, 10 total app
/// clocks, 11 total base clocks; any other is NVML_ERROR_INVALID_ARGUMENT, as is a null pointer.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetViolationStatus(
    h: nvmlDevice_t,
    policy: c_uint,
    out: *mut nvmlViolationTime_t,
) -> Ret {
    device_call(h, "nvmlDeviceGetViolationStatus", |d| {
        let name = match policy {
            0 => "power",
            1 => "thermal",
            2 => "sync_boost",
            3 => "board_limit",
            4 => "low_utilization",
            5 => "reliability",
            10 => "total_app_clocks",
            11 => "total_base_clocks",
            _ => return Some(INVALID),
        };
        if out.is_null() {
            return Some(INVALID);
        }
        let ns = *d.violations_ns.get(name)?;
        let now_us =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_micros() as u64);
        Some(put(out, nvmlViolationTime_t { referenceTime: now_us, violationTime: ns }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    h: nvmlDevice_t,
    corr: *mut c_uint,
    unc: *mut c_uint,
    pending: *mut c_uint,
    failure: *mut c_uint,
) -> Ret {
    device_call(h, "nvmlDeviceGetRemappedRows", |d| {
        let r = d.remapped_rows.as_ref()?;
        if corr.is_null() || unc.is_null() || pending.is_null() || failure.is_null() {
            return Some(INVALID);
        }
        *corr = r.correctable;
        *unc = r.uncorrectable;
        *pending = r.pending as c_uint;
        *failure = r.failure as c_uint;
        Some(OK)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(h: nvmlDevice_t, out: *mut nvmlEnableState_t) -> Ret {
    device_call(h, "nvmlDeviceGetPersistenceMode", |d| d.persistence_mode.map(|m| put(out, m as nvmlEnableState_t)))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(h: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) -> Ret {
    device_call(h, "nvmlDeviceGetMigMode", |d| {
        let m = d.mig.as_ref()?;
        Some(if put(current, m.current as c_uint) == OK { put(pending, m.pending as c_uint) } else { INVALID })
    })
}
