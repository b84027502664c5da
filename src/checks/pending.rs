//! The checks whose data source this build does not read yet (the CUDA driver API). They are
//! reported, never dropped: `unknown` with the reason when there are GPUs, a pass when there
//! is no NVIDIA GPU for them to be about.

use super::Finding;
use crate::snapshot::Snapshot;

const PENDING: &[(&str, &str)] = &[
    ("cuda.driver-api", "needs the CUDA driver API, which this build does not load yet"),
    ("cuda.init", "needs the CUDA driver API, which this build does not load yet"),
];

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    let no_gpu = s.gpus().is_empty();
    for (id, why) in PENDING {
        out.push(if no_gpu {
            Finding::pass(id, "no NVIDIA GPU: nothing to check")
        } else {
            Finding::unknown(id, *why)
        });
    }
}
