//! Modules and kernel launches (DRV: "Module Management", "Execution Control"). The fake
//! compiles nothing: it parses the PTX (`ptx`) and executes it with the interpreter (`interp`)
//! or, for a big launch, the kernel's Rust model (`kernels`).

use super::*;

/// Loads a PTX module (a NUL-terminated text) into the current context (DRV, cuModuleLoadData).
/// Text that is not PTX — no `.version` directive, or no `.entry` — is CUDA_ERROR_INVALID_PTX, as
/// the driver's JIT answers a module it cannot compile.
///
/// # Safety
/// `m` must be writable; `image` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut Handle, image: *const c_void) -> CUresult {
    if m.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    let text = CStr::from_ptr(image as *const c_char).to_string_lossy().into_owned();
    with(|w| {
        let ctx = match w.current_ctx() {
            Ok(c) => c,
            Err(e) => return e,
        };
        if !text.lines().any(|l| l.trim_start().starts_with(".version")) || !text.contains(".entry") {
            eprintln!("fake-cuda: cuModuleLoadData: not a PTX module with an .entry");
            return INVALID_PTX;
        }
        // A driver loads PTX of the ISA versions its CUDA release knows, and answers newer text
        // with CUDA_ERROR_UNSUPPORTED_PTX_VERSION (DRV, cuModuleLoadData). Which CUDA release
        // first loads each ISA version: the PTX ISA's release history, as NVIDIA's cuda-python
        // maps it (`cuda.bindings.utils.get_minimal_required_cuda_ver_from_ptx_ver`).
        let needs =
            text.lines().find_map(|l| l.trim_start().strip_prefix(".version")).and_then(|v| ptx_min_driver(v.trim()));
        match needs {
            Some(min) if w.scenario.driver_version < min => {
                eprintln!(
                    "fake-cuda: cuModuleLoadData: PTX needs CUDA {}.{}, the driver is CUDA {}.{}",
                    min / 1000,
                    min % 1000 / 10,
                    w.scenario.driver_version / 1000,
                    w.scenario.driver_version % 1000 / 10
                );
                return codes::UNSUPPORTED_PTX_VERSION;
            }
            None => {
                eprintln!("fake-cuda: cuModuleLoadData: a .version this fake does not know");
                return INVALID_PTX;
            }
            Some(_) => {}
        }
        // The module is parsed now, as the driver JIT-compiles it now: text that is not PTX is
        // CUDA_ERROR_INVALID_PTX here, not at launch.
        let parsed = match ptx::parse(&text) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                eprintln!("fake-cuda: cuModuleLoadData: {e}");
                return INVALID_PTX;
            }
        };
        let h = w.handle();
        w.modules.insert(h, Module { ctx, ptx: parsed });
        *m = h as Handle;
        SUCCESS
    })
}

/// The first CUDA driver (as `cuDriverGetVersion` reports it) that loads PTX ISA `version`
/// (the PTX ISA's release history: 6.5 with CUDA 10.2, 7.x with 11.x, 8.0–8.5 with 12.0–12.5,
/// 8.6 with 12.7, 8.7 with 12.8, 8.8 with 12.9, 9.x with 13.x).
fn ptx_min_driver(version: &str) -> Option<i32> {
    let (major, minor) = version.split_once('.')?;
    let (major, minor): (i32, i32) = (major.parse().ok()?, minor.parse().ok()?);
    Some(match (major, minor) {
        (6, 5) => 10020,
        (7, m) if m <= 8 => 11000 + 10 * m,
        (8, m) if m <= 5 => 12000 + 10 * m,
        (8, 6) => 12070,
        (8, 7) => 12080,
        (8, 8) => 12090,
        (9, m) if m <= 9 => 13000 + 10 * m,
        _ => return None,
    })
}

/// # Safety
/// As the real one.
#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: Handle) -> CUresult {
    with(|w| match w.modules.remove(&(m as usize)) {
        Some(_) => {
            w.functions.retain(|_, (module, _)| *module != m as usize);
            SUCCESS
        }
        None => INVALID_HANDLE,
    })
}

/// A kernel of a loaded module by name (DRV, cuModuleGetFunction): a name the module does not
/// declare is CUDA_ERROR_NOT_FOUND, an unknown module CUDA_ERROR_INVALID_HANDLE.
///
/// # Safety
/// `f` must be writable; `name` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut Handle, m: Handle, name: *const c_char) -> CUresult {
    if f.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let name = CStr::from_ptr(name).to_string_lossy().into_owned();
    with(|w| {
        let Some(module) = w.modules.get(&(m as usize)) else { return INVALID_HANDLE };
        if !module.ptx.functions.iter().any(|f| f.entry && f.name == name) {
            return NOT_FOUND;
        }
        let h = w.handle();
        w.functions.insert(h, (m as usize, name));
        *f = h as Handle;
        SUCCESS
    })
}

/// Launches a kernel on a stream of its module's context (DRV, cuLaunchKernel). A block of more
/// than 1024 threads is CUDA_ERROR_INVALID_VALUE (Hopper's limit, PG, "Compute Capabilities");
/// a stream of another context CUDA_ERROR_INVALID_HANDLE. The kernel's PTX runs through the
/// interpreter, or a big launch through its Rust model (`scenario::Path`); memory it may not
/// touch (freed, or a peer's without access) faults like a real kernel: the launch succeeds
/// and the context is poisoned with CUDA_ERROR_ILLEGAL_ADDRESS, seen by the next call.
///
/// # Safety
/// `params` must hold the kernel's arguments as the real launch takes them.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    _shared: c_uint,
    s: Handle,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    with(|w| {
        let Some((module, name)) = w.functions.get(&(f as usize)).cloned() else { return INVALID_HANDLE };
        let Some((mctx, code)) = w.modules.get(&module).map(|m| (m.ctx, m.ptx.clone())) else { return INVALID_HANDLE };
        let stream = match w.stream(s) {
            Ok(id) => id,
            Err(e) => return e,
        };
        if w.streams[&stream].ctx != mctx {
            eprintln!("fake-cuda: cuLaunchKernel: the stream belongs to another context than the kernel's module");
            return INVALID_HANDLE;
        }
        let threads = bx as u64 * by as u64 * bz as u64;
        if threads == 0 || threads > 1024 || gx == 0 || gy == 0 || gz == 0 {
            return INVALID_VALUE;
        }
        crate::hang::launched(&w.scenario, &name);
        kernels::launch(w, &code, &name, mctx, stream, params, [gx, gy, gz], [bx, by, bz])
    })
}
