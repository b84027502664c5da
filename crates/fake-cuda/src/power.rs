//! What a GPU's board draws while the fake's GEMMs run, told to the fake NVML in the same
//! process. A real board's power sensor sees the work the GPU does; here only fake-cuda knows
//! that work, so it keeps, per GPU, until when a GEMM loads it and what the board then draws,
//! and exports `phq_fake_cuda_load_mw` for the fake NVML (`crates/fake-nvml/src/load.rs`) to ask.
//!
//! Rules:
//! 1. A queued GEMM (cuBLAS's or the agent's own kernels) loads its GPU for its virtual time, and
//!    for at least `HOLD` of wall time: the fake's work costs no wall time, and NVML's reading on
//!    Hopper is an average over the last second anyway (NVML API reference,
//!    `nvmlDeviceGetPowerUsage`: "On Ampere (except GA100) or newer GPUs, the API returns power
//!    averaged over 1 sec interval").
//! 2. What a loaded board draws is the scenario's `power_under_load_w` — a weak power stage stalls
//!    short of its target there — or, absent, its enforced power limit, which the fake NVML knows
//!    (a board whose power management holds it at its limit under a full GEMM load: NVML API
//!    reference, `nvmlDeviceGetEnforcedPowerLimit`).

use std::ffi::{c_char, CStr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Rule 1: our choice, several of the agent's 100 ms power samples.
const HOLD: Duration = Duration::from_millis(500);

/// Per GPU (normalised PCI address): loaded until when, and its draw under load (mW; 0: its limit).
static LOADED: Mutex<Vec<(String, Instant, i64)>> = Mutex::new(Vec::new());

/// `0000:18:00.0` and NVML's `00000000:18:00.0` alike: the domain as a number, the rest lowercase.
fn normalise(pci: &str) -> Option<String> {
    let (domain, rest) = pci.trim().split_once(':')?;
    Some(format!("{:x}:{}", u32::from_str_radix(domain, 16).ok()?, rest.to_ascii_lowercase()))
}

/// Rule 1: GPU `pci` is loaded for `secs` of virtual time from now; rule 2: drawing `watts`.
pub(crate) fn loaded(pci: &str, secs: f64, watts: Option<f64>) {
    let Some(key) = normalise(pci) else { return };
    let until = Instant::now() + HOLD.max(Duration::from_secs_f64(secs.clamp(0.0, 10.0)));
    let mw = watts.map_or(0, |w| (w * 1000.0).round().max(1.0) as i64);
    let mut l = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    l.retain(|(k, _, _)| *k != key);
    l.push((key, until, mw));
}

/// For the fake NVML: -1 when GPU `pci` runs no GEMM now (or is unknown), 0 when it does and the
/// board draws its enforced limit, else the milliwatts it draws.
///
/// # Safety
/// `pci` must be a NUL-terminated string, or null.
#[no_mangle]
pub unsafe extern "C" fn phq_fake_cuda_load_mw(pci: *const c_char) -> i64 {
    if pci.is_null() {
        return -1;
    }
    let Some(key) = CStr::from_ptr(pci).to_str().ok().and_then(normalise) else { return -1 };
    let l = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    l.iter().find(|(k, until, _)| *k == key && Instant::now() < *until).map_or(-1, |(_, _, mw)| *mw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gemm_loads_its_gpu_for_a_while_and_names_the_draw() {
        let ask = |pci: &str| {
            let c = std::ffi::CString::new(pci).unwrap();
            unsafe { phq_fake_cuda_load_mw(c.as_ptr()) }
        };
        assert_eq!(ask("0000:77:00.0"), -1);
        loaded("0000:77:00.0", 0.0, None);
        assert_eq!(ask("00000000:77:00.0"), 0, "NVML's 8-digit domain is the same GPU");
        loaded("0000:78:00.0", 0.0, Some(420.0));
        assert_eq!(ask("0000:78:00.0"), 420_000);
        assert_eq!(ask("0000:79:00.0"), -1);
    }
}
