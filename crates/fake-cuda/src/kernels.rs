//! The kernels the fake can run, each a Rust reimplementation of a PTX kernel's contract,
//! chosen by the name the module declares. The agent ships no kernel yet (the device-kernels
//! work adds its memory test, copy and GEMM kernels here, one function per kernel); the one
//! below is the fake's own reference kernel, which its tests load from PTX text.
//!
//! Each reimplementation reads its arguments as `cuLaunchKernel` passes them (an array of
//! pointers, one per parameter, in the order the `.entry` declares them), checks that every
//! byte it touches is memory the launching context may reach, and charges the time the work
//! takes on the GPU's SMs and HBM.

use super::*;

/// Runs kernel `name` launched from context `ctx` on `stream`.
///
/// # Safety
/// `params` holds one pointer per parameter of the kernel, each to a value of its type.
pub(crate) unsafe fn launch(
    w: &mut World,
    name: &str,
    ctx: usize,
    stream: usize,
    params: *mut *mut c_void,
) -> CUresult {
    match name {
        "phq_fake_fill_u32" => fill_u32(w, ctx, stream, params),
        other => {
            eprintln!("fake-cuda: cuLaunchKernel: no reimplementation of kernel {other:?} in the fake");
            NOT_SUPPORTED
        }
    }
}

/// `phq_fake_fill_u32(u64 dst, u32 value, u64 count)`: `count` 32-bit words at `dst` set to
/// `value`, one write per byte of HBM traffic.
unsafe fn fill_u32(w: &mut World, ctx: usize, stream: usize, params: *mut *mut c_void) -> CUresult {
    if params.is_null() {
        return INVALID_VALUE;
    }
    let dst = *(*params.add(0) as *const u64);
    let value = *(*params.add(1) as *const u32);
    let count = *(*params.add(2) as *const u64);
    let dev = w.ctx_dev(ctx);
    let len = count * 4;
    match w.reaches_ptr(ctx, dst, len) {
        Ok(true) => {}
        Ok(false) | Err(_) => {
            eprintln!("fake-cuda: phq_fake_fill_u32: {dst:#x} is not memory this GPU may access");
            w.poison(dev, ILLEGAL_ADDRESS);
            return SUCCESS;
        }
    }
    if let Err(e) = w.fill(dst, len as usize, value) {
        return e;
    }
    let secs = len as f64 / (w.hbm_gbps(dev) * 1e9);
    w.run_on_sms(stream, secs);
    SUCCESS
}
