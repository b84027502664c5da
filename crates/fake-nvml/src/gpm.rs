//! NVML's GPM (GPU Performance Monitoring) calls: the profiling metrics DCGM serves as its
//! `DCGM_FI_PROF_*` fields on Hopper (DCGM computes them from these calls where
//! `nvmlGpmQueryDeviceSupport` says the GPU has GPM). Rules from nvml.h and the NVML API
//! reference, "GPM Functions":
//! - `nvmlGpmQueryDeviceSupport` fills `isSupportedDevice` (the scenario's `gpm` present: yes);
//!   its struct's `version` must be NVML_GPM_SUPPORT_VERSION, else
//!   NVML_ERROR_ARGUMENT_VERSION_MISMATCH.
//! - A sample is an opaque buffer from `nvmlGpmSampleAlloc`, filled by `nvmlGpmSampleGet` on a
//!   GPU with GPM (NVML_ERROR_NOT_SUPPORTED elsewhere) and freed by `nvmlGpmSampleFree`.
//! - `nvmlGpmMetricsGet` computes each asked metric over the interval between two samples of
//!   one GPU: `version` must be NVML_GPM_METRICS_GET_VERSION, at most NVML_GPM_METRIC_MAX
//!   metrics, both samples filled, of the same GPU, the second taken after the first
//!   (NVML_ERROR_INVALID_ARGUMENT otherwise). Each metric carries its own return code: a metric
//!   the GPU does not measure is NVML_ERROR_NOT_SUPPORTED there, and the call still succeeds.
//!
//! Values are the scenario's (`gpm.metrics`, by NVML's metric id: percentages for the
//! utilisations, MiB/s for the PCIe and NVLink rates, as nvml.h documents each id); `null`
//! stands for a NaN the GPU reported.

use crate::{index_of, with_state, INVALID, NOT_SUPPORTED, OK};
use nvml_wrapper_sys::bindings::*;
use std::time::Instant;

type Ret = nvmlReturn_t;

/// A sample: which GPU, and when (the fake's own layout behind NVML's opaque pointer).
struct Sample {
    device: Option<usize>,
    at: Option<Instant>,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(h: nvmlDevice_t, out: *mut nvmlGpmSupport_t) -> Ret {
    if out.is_null() {
        return INVALID;
    }
    if (*out).version != NVML_GPM_SUPPORT_VERSION {
        return crate::ARGUMENT_VERSION_MISMATCH;
    }
    with_state(|s| {
        let d = s.scenario.devices.get(index_of(h)).ok_or(INVALID)?;
        (*out).isSupportedDevice = u32::from(d.gpm.is_some());
        Ok(OK)
    })
    .unwrap_or_else(|e| e)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(out: *mut nvmlGpmSample_t) -> Ret {
    if out.is_null() {
        return INVALID;
    }
    *out = Box::into_raw(Box::new(Sample { device: None, at: None })) as nvmlGpmSample_t;
    OK
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> Ret {
    if sample.is_null() {
        return INVALID;
    }
    // SAFETY: the caller hands back what nvmlGpmSampleAlloc gave, once.
    drop(Box::from_raw(sample as *mut Sample));
    OK
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleGet(h: nvmlDevice_t, sample: nvmlGpmSample_t) -> Ret {
    if sample.is_null() {
        return INVALID;
    }
    let r = crate::device_call(h, "nvmlGpmSampleGet", |d| d.gpm.as_ref().map(|_| OK));
    if r == OK {
        let s = &mut *(sample as *mut Sample);
        s.device = Some(index_of(h));
        s.at = Some(Instant::now());
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmMetricsGet(m: *mut nvmlGpmMetricsGet_t) -> Ret {
    if m.is_null() {
        return INVALID;
    }
    let m = &mut *m;
    if m.version != NVML_GPM_METRICS_GET_VERSION {
        return crate::ARGUMENT_VERSION_MISMATCH;
    }
    if m.numMetrics as usize > m.metrics.len() || m.sample1.is_null() || m.sample2.is_null() {
        return INVALID;
    }
    let (a, b) = (&*(m.sample1 as *const Sample), &*(m.sample2 as *const Sample));
    let (Some(dev), Some(t1), Some(t2)) = (a.device, a.at, b.at) else { return INVALID };
    if b.device != Some(dev) || t2 <= t1 {
        return INVALID;
    }
    with_state(|s| {
        let d = s.scenario.devices.get(dev).ok_or(INVALID)?;
        let gpm = d.gpm.as_ref().ok_or(NOT_SUPPORTED)?;
        for metric in m.metrics.iter_mut().take(m.numMetrics as usize) {
            match gpm.metrics.get(&metric.metricId.to_string()) {
                Some(v) => {
                    metric.nvmlReturn = OK;
                    metric.value = v.unwrap_or(f64::NAN);
                }
                None => metric.nvmlReturn = NOT_SUPPORTED,
            }
        }
        Ok(OK)
    })
    .unwrap_or_else(|e| e)
}
