//! The CUDA driver API as the guest's applications meet it: is libcuda there, which CUDA version
//! does it offer, does `cuInit` succeed (error 802 when the fabric manager has not set up the
//! NVSwitch fabric, 100 when no GPU is visible).
//!
//! libcuda is loaded at run time (`crate::cuda`); its absence is a finding, not a crash.

use crate::snapshot::{CudaStage, CudaStatus};

/// The first CUDA 12 driver API version (`cuDriverGetVersion` gives 12000 for 12.0).
pub const MIN_DRIVER_API: i32 = 12000;

pub fn read() -> CudaStatus {
    let drv = match crate::cuda::driver() {
        Ok(d) => d,
        Err(e) => return CudaStatus::Failed { stage: CudaStage::Library, code: None, message: e.to_string() },
    };
    let version = match drv.version() {
        Ok(v) => v,
        Err(e) => {
            return CudaStatus::Failed { stage: CudaStage::DriverVersion, code: Some(e.code), message: describe(&e) }
        }
    };
    if let Err(e) = drv.init() {
        return CudaStatus::Failed { stage: CudaStage::Init, code: Some(e.code), message: describe(&e) };
    }
    let devices = drv.device_count().unwrap_or(0);
    CudaStatus::Ok { driver_api_version: version, devices: devices as u32 }
}

/// `CUDA_ERROR_SYSTEM_NOT_READY (802): system not yet initialized`: the error without the call.
pub fn describe(e: &crate::cuda::CudaError) -> String {
    let text = if e.text.is_empty() { String::new() } else { format!(": {}", e.text) };
    format!("{} ({}){text}", e.name, e.code)
}

/// `12040` → `12.4`.
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
