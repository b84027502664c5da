//! Initialisation, version, errors, devices and contexts (DRV: "Initialization", "Version
//! Management", "Error Handling", "Device Management", "Primary Context Management",
//! "Context Management").

use super::*;

/// # Safety
/// As the real cuInit.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    let mut g = lock();
    if g.is_none() {
        *g = Some(load_world());
    }
    match g.as_ref() {
        Some(Ok(_)) => SUCCESS,
        Some(Err(e)) => *e,
        None => NOT_INITIALIZED,
    }
}

/// Answers without cuInit, as the real one does.
///
/// # Safety
/// `v` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    if v.is_null() {
        return INVALID_VALUE;
    }
    let version = std::env::var("PHQ_FAKE_CUDA_SCENARIO")
        .ok()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|j| j.get("driver_version").and_then(|v| v.as_i64()))
        .unwrap_or(12080);
    *v = version as c_int;
    SUCCESS
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, out: *mut *const c_char) -> CUresult {
    error_text(code, out, true)
}

/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, out: *mut *const c_char) -> CUresult {
    error_text(code, out, false)
}

unsafe fn error_text(code: CUresult, out: *mut *const c_char, name: bool) -> CUresult {
    static NAMES: std::sync::OnceLock<Vec<(CUresult, std::ffi::CString, std::ffi::CString)>> =
        std::sync::OnceLock::new();
    let table = NAMES.get_or_init(|| {
        TABLE
            .iter()
            .filter_map(|(c, n, t)| Some((*c, std::ffi::CString::new(*n).ok()?, std::ffi::CString::new(*t).ok()?)))
            .collect()
    });
    if out.is_null() {
        return INVALID_VALUE;
    }
    match table.iter().find(|(c, _, _)| *c == code) {
        Some((_, n, t)) => {
            *out = if name { n.as_ptr() } else { t.as_ptr() };
            SUCCESS
        }
        None => {
            *out = std::ptr::null();
            INVALID_VALUE
        }
    }
}

/// # Safety
/// `count` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    if count.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        *count = w.order.len() as c_int;
        SUCCESS
    })
}

/// # Safety
/// `dev` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(ordinal) {
        Ok(_) => {
            *dev = ordinal;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `name` must hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            write_c_string(&w.spec(d).name, name, len as usize);
            SUCCESS
        }
        Err(e) => e,
    })
}

unsafe fn write_c_string(s: &str, out: *mut c_char, len: usize) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(len - 1);
    std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, out, n);
    *out.add(n) = 0;
}

/// `0000:18:00.0` (DRV, cuDeviceGetPCIBusId: "[domain]:[bus]:[device].[function]").
///
/// # Safety
/// `out` must hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(out: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    if out.is_null() || len < 13 {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            write_c_string(&w.spec(d).pci_bus_id, out, len as usize);
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `bytes` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    if bytes.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            *bytes = w.spec(d).memory_bytes as usize;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `uuid` must hold 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut u8, dev: CUdevice) -> CUresult {
    if uuid.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            for i in 0..16 {
                *uuid.add(i) = (d as u8).wrapping_mul(31).wrapping_add(i as u8);
            }
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `uuid` must hold 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: CUdevice) -> CUresult {
    cuDeviceGetUuid(uuid, dev)
}

/// The attributes the agent and cudarc ask; any other valid attribute reads 0.
///
/// # Safety
/// `value` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    if value.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let d = match w.device(dev) {
            Ok(d) => d,
            Err(e) => return e,
        };
        let spec = w.spec(d);
        let bus = u32::from_str_radix(spec.pci_bus_id.get(5..7).unwrap_or("0"), 16).unwrap_or(0);
        *value = match attrib {
            1 => 1024, // MAX_THREADS_PER_BLOCK
            16 => 132, // MULTIPROCESSOR_COUNT (H100 SXM)
            20 => match spec.compute_mode {
                // COMPUTE_MODE
                ComputeMode::Default => 0,
                ComputeMode::Prohibited => 2,
                ComputeMode::ExclusiveProcess => 3,
            },
            33 => bus as c_int,                                // PCI_BUS_ID
            38 => spec.l2_bytes.min(i32::MAX as u64) as c_int, // L2_CACHE_SIZE
            41 => 1,                                           // UNIFIED_ADDRESSING
            75 => 9,                                           // COMPUTE_CAPABILITY_MAJOR
            76 => 0,                                           // COMPUTE_CAPABILITY_MINOR
            115 => 1,                                          // MEMORY_POOLS_SUPPORTED
            132 => w.scenario.multicast() as c_int,            // MULTICAST_SUPPORTED
            a if (1..=150).contains(&a) => 0,
            _ => return INVALID_VALUE,
        };
        SUCCESS
    })
}

/// Retains the device's primary context. In exclusive-process mode with another process on the
/// GPU, or in prohibited mode, no context can be made: CUDA_ERROR_DEVICE_UNAVAILABLE ("devices
/// are often unavailable due to use of CU_COMPUTEMODE_EXCLUSIVE_PROCESS or
/// CU_COMPUTEMODE_PROHIBITED", DRV, `CUresult`).
///
/// # Safety
/// `ctx` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: CUdevice) -> CUresult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let d = match w.device(dev) {
            Ok(d) => d,
            Err(e) => return e,
        };
        if let Some(h) = w.primary[d] {
            if let Some(c) = w.contexts.get_mut(&h) {
                c.refs += 1;
            }
            *ctx = h as Handle;
            return SUCCESS;
        }
        let spec = w.spec(d);
        if spec.compute_mode == ComputeMode::Prohibited
            || (spec.compute_mode == ComputeMode::ExclusiveProcess && spec.other_process)
        {
            return DEVICE_UNAVAILABLE;
        }
        if w.used[d] + spec.context_bytes > spec.memory_bytes {
            return OUT_OF_MEMORY;
        }
        w.used[d] += spec.context_bytes;
        let (h, s) = (w.handle(), w.handle());
        w.contexts.insert(h, Ctx { device: d, refs: 1, peers: Vec::new(), default_stream: s });
        w.streams.insert(s, Stream { ctx: h, clock: 0.0 });
        w.primary[d] = Some(h);
        w.trace_context(d);
        *ctx = h as Handle;
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    with(|w| {
        let d = match w.device(dev) {
            Ok(d) => d,
            Err(e) => return e,
        };
        let Some(h) = w.primary[d] else { return INVALID_CONTEXT };
        let refs = {
            let Some(c) = w.contexts.get_mut(&h) else { return INVALID_CONTEXT };
            c.refs -= 1;
            c.refs
        };
        if refs == 0 {
            w.destroy_context(h);
        }
        SUCCESS
    })
}

/// # Safety
/// `flags` and `active` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    if flags.is_null() || active.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            *flags = 0;
            *active = w.primary[d].is_some() as c_int;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// As the real one; a null context unbinds the thread.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    with(|w| {
        let h = ctx as usize;
        if h != 0 && !w.contexts.contains_key(&h) {
            return INVALID_CONTEXT;
        }
        CURRENT.with(|c| c.set(h));
        SUCCESS
    })
}

/// # Safety
/// `ctx` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> CUresult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let h = current();
        *ctx = if w.contexts.contains_key(&h) { h as Handle } else { std::ptr::null_mut() };
        SUCCESS
    })
}

/// # Safety
/// `dev` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.current_ctx() {
        Ok(c) => {
            *dev = w.ordinal_of(w.contexts[&c].device) as CUdevice;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// Work is done when it is queued, so synchronising only reports a sticky error.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    crate::hang::settle(with(|w| match w.current_ctx() {
        Ok(_) if crate::hang::sync_blocks(&w.scenario, "cuCtxSynchronize") => crate::hang::BLOCK,
        Ok(c) => {
            kernels::settle_gates(w);
            let done = w.streams.values().filter(|s| s.ctx == c).map(|s| s.clock).fold(w.now, f64::max);
            w.now = done;
            SUCCESS
        }
        Err(e) => e,
    }))
}

/// # Safety
/// `lo` and `hi` may be null.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(lo: *mut c_int, hi: *mut c_int) -> CUresult {
    if !lo.is_null() {
        *lo = 0;
    }
    if !hi.is_null() {
        *hi = -5;
    }
    SUCCESS
}
