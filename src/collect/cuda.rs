//! The CUDA driver API as the guest's applications meet it: is libcuda there, which CUDA version
//! does it offer, does `cuInit` succeed (error 802 when the fabric manager has not set up the
//! NVSwitch fabric, 100 when no GPU is visible).
//!
//! cudarc loads libcuda at run time and panics when it is missing, so presence is checked first
//! with its `is_culib_present()`, and nothing else in cudarc is touched when it says no.

use crate::snapshot::{CudaStage, CudaStatus};
use cudarc::driver::sys;

/// The first CUDA 12 driver API version (`cuDriverGetVersion` gives 12000 for 12.0).
pub const MIN_DRIVER_API: i32 = 12000;

pub fn read() -> CudaStatus {
    // SAFETY: only tries to dlopen libcuda under its usual names, then closes it.
    if !unsafe { sys::is_culib_present() } {
        return CudaStatus::Failed {
            stage: CudaStage::Library,
            code: None,
            message: "libcuda.so (the NVIDIA driver's CUDA library) was not found by the dynamic loader".into(),
        };
    }
    let mut version = 0;
    // SAFETY: libcuda is present (checked above), so cudarc's loader will not panic; the out
    // pointer is a valid local.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return CudaStatus::Failed { stage: CudaStage::DriverVersion, code: Some(r as i32), message: describe(r) };
    }
    if let Err(e) = cudarc::driver::result::init() {
        return CudaStatus::Failed { stage: CudaStage::Init, code: Some(e.0 as i32), message: describe(e.0) };
    }
    let devices = cudarc::driver::result::device::get_count().unwrap_or(0);
    CudaStatus::Ok { driver_api_version: version, devices: devices.max(0) as u32 }
}

/// `CUDA_ERROR_SYSTEM_NOT_READY (802): system not yet initialized`.
pub fn describe(r: sys::CUresult) -> String {
    let e = cudarc::driver::result::DriverError(r);
    let name = e.error_name().map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{r:?}"));
    let text = e.error_string().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name} ({}){}", r as i32, if text.is_empty() { String::new() } else { format!(": {text}") })
}

/// `12040` → `12.4`.
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
