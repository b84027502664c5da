//! Device, pool and page-locked host memory, copies and memsets (DRV: "Memory Management",
//! "Stream Ordered Memory Allocator").

use super::*;

/// # Safety
/// `free` and `total` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.current_ctx() {
        Ok(c) => {
            let d = w.contexts[&c].device;
            *total = w.spec(d).memory_bytes as usize;
            *free = w.spec(d).memory_bytes.saturating_sub(w.used[d]) as usize;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `ptr` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let c = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        match w.alloc(c, bytes, false) {
            Ok(p) => {
                *ptr = p;
                SUCCESS
            }
            Err(e) => e,
        }
    })
}

/// Freeing twice, or a pointer no allocation returned, is CUDA_ERROR_INVALID_VALUE.
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    with(|w| w.free(ptr))
}

/// Allocates from the stream's device's default pool (DRV, cuMemAllocAsync).
///
/// # Safety
/// `ptr` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(ptr: *mut CUdeviceptr, bytes: usize, s: Handle) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let c = w.streams[&id].ctx;
        match w.alloc(c, bytes, true) {
            Ok(p) => {
                *ptr = p;
                SUCCESS
            }
            Err(e) => e,
        }
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: CUdeviceptr, s: Handle) -> CUresult {
    with(|w| match w.stream(s) {
        Ok(_) => w.free(ptr),
        Err(e) => e,
    })
}

/// # Safety
/// `pool` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: CUdevice) -> CUresult {
    if pool.is_null() {
        return INVALID_VALUE;
    }
    with(|w| match w.device(dev) {
        Ok(d) => {
            *pool = w.default_pool[d] as Handle;
            SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `pool` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut Handle, dev: CUdevice) -> CUresult {
    cuDeviceGetDefaultMemPool(pool, dev)
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(pool: Handle, _attr: c_int, _value: *mut c_void) -> CUresult {
    with(|w| if w.pools.contains_key(&(pool as usize)) { SUCCESS } else { INVALID_HANDLE })
}

/// # Safety
/// `value` must hold a u64.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(pool: Handle, _attr: c_int, value: *mut c_void) -> CUresult {
    if value.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        if !w.pools.contains_key(&(pool as usize)) {
            return INVALID_HANDLE;
        }
        *(value as *mut u64) = 0;
        SUCCESS
    })
}

/// `CUmemAccessDesc`: a location (type, id) and the access flags.
#[repr(C)]
pub struct MemAccessDesc {
    pub location_type: c_int,
    pub location_id: c_int,
    pub flags: c_int,
}

/// Grants devices access to a pool's allocations (DRV, cuMemPoolSetAccess).
///
/// # Safety
/// `desc` must hold `count` descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAccess(pool: Handle, desc: *const MemAccessDesc, count: usize) -> CUresult {
    if desc.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let descs = std::slice::from_raw_parts(desc, count);
        let mut grant = Vec::new();
        for d in descs {
            // CU_MEM_LOCATION_TYPE_DEVICE = 1; CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3.
            if d.location_type != 1 {
                return INVALID_VALUE;
            }
            match w.device(d.location_id) {
                Ok(dev) => grant.push((dev, d.flags)),
                Err(e) => return e,
            }
        }
        let Some(p) = w.pools.get_mut(&(pool as usize)) else { return INVALID_HANDLE };
        for (dev, flags) in grant {
            p.access.retain(|x| *x != dev);
            if flags != 0 && dev != p.device {
                p.access.push(dev);
            }
        }
        SUCCESS
    })
}

/// Page-locked host memory for the current context (DRV, cuMemHostAlloc). Flags other than
/// CU_MEMHOSTALLOC_PORTABLE (1), DEVICEMAP (2) and WRITECOMBINED (4) are CUDA_ERROR_INVALID_VALUE.
///
/// # Safety
/// `pp` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, flags: c_uint) -> CUresult {
    if pp.is_null() || bytes == 0 || flags & !0x7 != 0 {
        return INVALID_VALUE;
    }
    with(|w| {
        if let Err(e) = w.current_ctx() {
            return e;
        }
        let Ok(layout) = std::alloc::Layout::from_size_align(bytes, 4096) else { return INVALID_VALUE };
        let p = std::alloc::alloc_zeroed(layout);
        if p.is_null() {
            return OUT_OF_MEMORY;
        }
        w.pinned.insert(p as usize, (bytes, layout));
        *pp = p as *mut c_void;
        SUCCESS
    })
}

/// The device pointer of page-locked host memory (DRV, cuMemHostGetDevicePointer): flags must be 0
/// (CUDA_ERROR_INVALID_VALUE otherwise); memory that is not from cuMemHostAlloc is
/// CUDA_ERROR_INVALID_VALUE. Under unified addressing every cuMemHostAlloc allocation is mapped
/// whatever its flags, and "the pointer value through which allocated host memory may be
/// accessed in kernels ... is the same as the pointer value through which that memory is
/// accessed on the host" (DRV, "Unified Addressing": automatic mapping of host allocated host
/// memory): the fake answers the host pointer.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    if out.is_null() || flags != 0 {
        return INVALID_VALUE;
    }
    with(|w| {
        if let Err(e) = w.current_ctx() {
            return e;
        }
        if !w.host_mapped(p as u64, 1) {
            return INVALID_VALUE;
        }
        *out = p as u64;
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    with(|w| match w.pinned.remove(&(p as usize)) {
        Some((_, layout)) => {
            std::alloc::dealloc(p as *mut u8, layout);
            SUCCESS
        }
        None => INVALID_VALUE,
    })
}

/// A host→device copy on the device's host→device copy engine. A copy may be queued on a
/// stream of another device: "a memory copy will succeed even if it is issued to a stream that
/// is not associated to the current device" (PG, "Stream and Event Behavior").
///
/// # Safety
/// `src` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: Handle) -> CUresult {
    if src.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let dev = match w.find(dst, n as u64) {
            Ok((b, _)) => w.allocs[&b].device,
            Err(e) => return e,
        };
        if let Err(e) = w.fault(dev, FaultOn::Memcpy) {
            return e;
        }
        let bytes = std::slice::from_raw_parts(src as *const u8, n);
        if let Err(e) = w.write(dst, bytes) {
            return e;
        }
        w.l2_touch(dst, n as u64, n as u64, true, false);
        let secs = n as f64 / (w.spec(dev).h2d_gbps * 1e9);
        w.occupy(id, &[Engine::HostToDevice(dev)], secs);
        SUCCESS
    })
}

/// # Safety
/// `dst` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    if dst.is_null() {
        return INVALID_VALUE;
    }
    with(|w| {
        let id = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        let dev = match w.find(src, n as u64) {
            Ok((b, _)) => w.allocs[&b].device,
            Err(e) => return e,
        };
        if let Err(e) = w.fault(dev, FaultOn::Memcpy) {
            return e;
        }
        if let Err(e) = w.read_into(src, std::slice::from_raw_parts_mut(dst as *mut u8, n)) {
            return e;
        }
        w.l2_touch(src, n as u64, n as u64, false, false);
        let secs = n as f64 / (w.spec(dev).d2h_gbps * 1e9);
        w.occupy(id, &[Engine::DeviceToHost(dev)], secs);
        SUCCESS
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    with(|w| match w.stream(s) {
        Ok(id) => w.copy_dd(dst, src, n, id),
        Err(e) => e,
    })
}

/// A copy between two contexts' memory (DRV, cuMemcpyPeerAsync). Direct over the peer link
/// when the stream's context reaches the other GPU's buffer; staged through host memory,
/// at PCIe speed, when it does not (see `copy_dd`).
///
/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: CUdeviceptr,
    dst_ctx: Handle,
    src: CUdeviceptr,
    src_ctx: Handle,
    n: usize,
    s: Handle,
) -> CUresult {
    with(|w| {
        if !w.contexts.contains_key(&(dst_ctx as usize)) || !w.contexts.contains_key(&(src_ctx as usize)) {
            return INVALID_CONTEXT;
        }
        match w.stream(s) {
            Ok(id) => w.copy_dd(dst, src, n, id),
            Err(e) => e,
        }
    })
}

/// # Safety
/// `src` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    cuMemcpyHtoDAsync_v2(dst, src, n, std::ptr::null_mut())
}

/// # Safety
/// `dst` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    cuMemcpyDtoHAsync_v2(dst, src, n, std::ptr::null_mut())
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    cuMemcpyDtoDAsync_v2(dst, src, n, std::ptr::null_mut())
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(ptr: CUdeviceptr, value: u8, n: usize, s: Handle) -> CUresult {
    with(|w| w.memset(ptr, &[value], n, s))
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(ptr: CUdeviceptr, value: c_uint, n: usize, s: Handle) -> CUresult {
    // cuMemsetD32 needs a 4-byte aligned pointer (DRV, cuMemsetD32: "dstDevice ... must be four
    // byte aligned").
    if !ptr.is_multiple_of(4) {
        return INVALID_VALUE;
    }
    with(|w| w.memset(ptr, &value.to_le_bytes(), n, s))
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(ptr: CUdeviceptr, value: u8, n: usize) -> CUresult {
    cuMemsetD8Async(ptr, value, n, std::ptr::null_mut())
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(ptr: CUdeviceptr, value: c_uint, n: usize) -> CUresult {
    cuMemsetD32Async(ptr, value, n, std::ptr::null_mut())
}
