//! The checks whose data source this build does not read yet (NVML, the CUDA driver API,
//! systemd over D-Bus). They are reported, never dropped: `unknown` with the reason when there
//! are GPUs, a pass when there is no NVIDIA GPU for them to be about.

use super::Finding;
use crate::snapshot::Snapshot;

/// Why a check cannot run in this build, by id prefix or exact id.
const PENDING: &[(&str, &str)] = &[
    ("driver.persistence", "needs NVML and systemd unit states, which this build does not read yet"),
    ("nvml.init", "needs NVML, which this build does not load yet"),
    ("cuda.driver-api", "needs the CUDA driver API, which this build does not load yet"),
    ("cuda.init", "needs the CUDA driver API, which this build does not load yet"),
    ("fabric.", "needs NVML and systemd unit states, which this build does not read yet"),
    ("nvlink.", "needs NVML, which this build does not load yet"),
    ("gpu.", "needs NVML, which this build does not load yet"),
];

/// Checks in the `gpu.` area that are already implemented without NVML.
const IMPLEMENTED: &[&str] = &["gpu.xid", "gpu.sku-known"];

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    let no_gpu = s.gpus().is_empty();
    for id in super::CATALOG.iter().filter(|id| !IMPLEMENTED.contains(id)) {
        let Some((_, why)) = PENDING.iter().find(|(p, _)| if p.ends_with('.') { id.starts_with(p) } else { id == p })
        else {
            continue;
        };
        out.push(if no_gpu {
            Finding::pass(id, "no NVIDIA GPU: nothing to check")
        } else {
            Finding::unknown(id, *why)
        });
    }
}
