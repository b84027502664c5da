//! The here-and-now runner: the probes on this machine's GPUs (CUDA for the measuring, the
//! snapshot for what each GPU is), under the run lock, with NVML's readings beside each figure
//! through the caller's session; and what such a run would do (`--dry-run`), from the snapshot
//! alone.

use super::budget::{self, Plan};
use super::cuda_backend::{self, CudaBackend};
use super::levels::Options;
use super::lock;
use super::observed::Observed;
use super::results::ProbeReport;
use super::run::run;
use super::targets::{targets_of, DeviceInfo, Target};
use crate::collect::nvml::Session;

/// Why probes could not run here.
#[derive(Debug, thiserror::Error)]
pub enum NotRun {
    #[error(transparent)]
    Cuda(#[from] cuda_backend::Unavailable),
    #[error(transparent)]
    Busy(#[from] lock::Held),
}

/// Probes the GPUs of this machine: CUDA for the measuring, the snapshot for each GPU's SKU, its
/// NVLinks and the compute processes that keep a probe off a GPU; `nvml`, the session the
/// snapshot was read through, for NVML's reading beside each figure. Holds the run lock in
/// `state_dir` for `who` throughout.
pub fn run_here(
    snapshot: &crate::snapshot::Snapshot,
    nvml: Option<&Session>,
    opts: &Options<'_>,
    state_dir: &std::path::Path,
    who: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(ProbeReport, Vec<Target>), NotRun> {
    let _lock = lock::acquire(state_dir, who)?;
    let (mut backend, devices) = CudaBackend::open()?;
    backend.level = opts.level;
    let targets = targets_of(snapshot, &devices, std::process::id());
    // NVML beside CUDA, for the clocks after each measurement, where the snapshot could read it;
    // without it the figures stand alone.
    let session = nvml.filter(|_| snapshot.nvml().is_some());
    let pcis = devices.iter().map(|d| d.pci.clone()).collect();
    let mut observed = Observed::new(&mut backend, session, pcis);
    Ok((run(&mut observed, &targets, opts, progress), targets))
}

/// What a run would do here, from the snapshot alone: no CUDA driver is loaded and no GPU touched. The
/// GPUs are the snapshot's NVIDIA GPUs in PCI order (as CUDA numbers them under
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`). `cublas`: plan the GEMMs at cuBLAS's rates (the run will
/// find it) rather than the agent's own kernels' slower ones.
pub fn plan_here(snapshot: &crate::snapshot::Snapshot, opts: &Options<'_>, cublas: bool) -> Plan {
    let mut pcis: Vec<String> = snapshot.gpus().iter().map(|g| g.address.clone()).collect();
    pcis.sort();
    let devices: Vec<DeviceInfo> = pcis.into_iter().map(|pci| DeviceInfo { pci, compute_mode: 0 }).collect();
    let targets = targets_of(snapshot, &devices, std::process::id());
    let memory = |pci: &str| snapshot.nvml_gpu(pci).and_then(|g| g.memory.value()).map(|m| m.total_bytes);
    budget::estimate(&targets, opts, &memory, cublas)
}
